"""The decoder layer that targets and drafters share: a token mixer (attention), then a SwiGLU MLP,
each a pre-norm block over the residual stream whose norm runs in the GEMM after it and whose
residual add runs in the GEMM before it (`blockspec.layers.linear`). q/k/v and gate/up are packed
into one projection each (`packed_parts`), so that each is one GEMM.

A layer's kind (`LayerKind`) names its mixer and its MLP. `MIXERS` and `MLPS` hold the modules of
the kinds built so far, and the cache a mixer keeps per sequence (paged K/V, or a recurrent state
in a slot): a new kind is a module and an entry there."""

from dataclasses import dataclass

import torch
from torch import nn

from blockspec.layers.attention import AttentionMetadata
from blockspec.layers.gated_deltanet import GatedDeltaNet, LinearAttentionSpec
from blockspec.layers.linear import Linear
from blockspec.layers.mlp import MLP
from blockspec.layers.moe import MoESpec, SparseMoE
from blockspec.layers.norm import RMSNorm, fold_norm_weight

KVCache = tuple[torch.Tensor, torch.Tensor]
Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin
Packing = dict[str, list[tuple[str, int]]]  # packed projection -> its checkpoint parts and their rows, in order
PAGED_KV = "paged_kv"  # K/V of every position in the paged pools
RECURRENT_STATE = "recurrent_state"  # a fixed-size state per sequence, in its state slot


@dataclass(frozen=True)
class LayerSpec:
    """The widths and options all layers of a model share."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # per-head RMSNorm of q and k before rope (Qwen3)
    attention_sinks: bool = False  # a learned logit per head in every softmax (gpt-oss)
    moe: MoESpec | None = None  # the experts of the layers whose MLP is "sparse_moe"
    linear_attention: LinearAttentionSpec | None = None  # the "linear_attention" layers' widths
    # q_proj also makes a per-channel output gate (Qwen3.5, Qwen3-Next): o = attention * sigmoid(gate)
    attn_output_gate: bool = False


@dataclass(frozen=True)
class LayerKind:
    """What one layer is: its token mixer, named as Hugging Face's `layer_types` name it (full or
    sliding-window attention), and its MLP."""

    attention: str = "full_attention"
    mlp: str = "dense"

    @property
    def cache(self) -> str:
        """What the layer keeps of each sequence between steps (`MIXERS`)."""
        return MIXERS[self.attention].cache


def packed_parts(s: LayerSpec) -> Packing:
    """Each packed projection's checkpoint parts, in order, and the rows of each."""
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    gate = [("o_gate_proj", q)] if s.attn_output_gate else []
    packing = {
        "qkv_proj": [("q_proj", q), ("k_proj", kv), ("v_proj", kv), *gate],
        "gate_up_proj": [("gate_proj", s.intermediate_size), ("up_proj", s.intermediate_size)],
    }
    if s.moe is not None and s.moe.shared_expert_intermediate_size:  # packed first: its names hold ".gate_proj."
        n = s.moe.shared_expert_intermediate_size
        packing = {
            "shared_expert.gate_up_proj": [("shared_expert.gate_proj", n), ("shared_expert.up_proj", n)]
        } | packing
    if (la := s.linear_attention) is not None:
        heads = la.num_value_heads
        packing["in_proj"] = [
            ("in_proj_qkv", la.conv_dim),
            ("in_proj_z", la.value_dim),
            ("in_proj_b", heads),
            ("in_proj_a", heads),
        ]
    return packing


def weight(norm: RMSNorm | None) -> torch.Tensor | None:
    return norm.weight if norm is not None else None


class Attention(nn.Module):
    def __init__(self, s: LayerSpec, layer_type: str) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = s.num_heads, s.num_kv_heads, s.head_dim
        self.layer_type = layer_type
        self.q_size, self.kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        self.output_gate = s.attn_output_gate
        gate_size = self.q_size if self.output_gate else 0
        # q|k|v (and the output gate's rows): one GEMM
        self.qkv_proj = Linear(s.hidden_size, self.q_size + 2 * self.kv_size + gate_size, bias=s.qkv_bias)
        self.o_proj = Linear(s.num_heads * s.head_dim, s.hidden_size, bias=s.o_bias)
        self.eps = s.eps
        self.q_norm = RMSNorm(s.head_dim, s.eps) if s.qk_norm else None
        self.k_norm = RMSNorm(s.head_dim, s.eps) if s.qk_norm else None
        self.sinks = nn.Parameter(torch.zeros(s.num_heads)) if s.attention_sinks else None

    def forward(
        self,
        x: torch.Tensor,
        norm: RMSNorm | None,
        rope: Rope,
        cache: KVCache,
        attn: AttentionMetadata,
        residual: bool = True,
    ) -> torch.Tensor:
        """x + attention(norm(x)) (without `residual`: attention(norm(x))): the norm runs in the
        qkv GEMM, the add in the o GEMM."""
        qkv = self.qkv_proj(x, norm=norm).view(*x.shape[:-1], -1, self.head_dim)
        if self.output_gate:
            qkv, gate = qkv.split([qkv.shape[-2] - self.num_heads, self.num_heads], dim=-2)
            qkv = qkv.contiguous()  # the attention kernels read q|k|v packed
        heads, norms = (self.num_heads, self.num_kv_heads), (weight(self.q_norm), weight(self.k_norm))
        out = attn.attend_qkv(
            qkv, norms, self.eps, rope, heads, cache, self.layer_type, self.head_dim**-0.5, self.sinks
        )
        if self.output_gate:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out.flatten(-2), residual=x if residual else None)

    def fold_norm(self, norm: RMSNorm) -> None:
        fold_norm_weight(norm, self.qkv_proj)


class DenseMLP(MLP):
    """The dense MLP kind, built from the layer spec as every MLP kind is."""

    def __init__(self, s: LayerSpec) -> None:
        super().__init__(s.hidden_size, s.intermediate_size, s.mlp_bias)


@dataclass(frozen=True)
class Mixer:
    """A mixer kind: its module, built as module(spec, kind), the cache it keeps per sequence, and
    the layer attribute that holds it (Hugging Face's parameter names)."""

    module: type[nn.Module]
    cache: str
    attribute: str = "self_attn"


MIXERS: dict[str, Mixer] = {
    "full_attention": Mixer(Attention, PAGED_KV),
    "sliding_attention": Mixer(Attention, PAGED_KV),  # keys of the last `sliding_window` positions
    "linear_attention": Mixer(GatedDeltaNet, RECURRENT_STATE, "linear_attn"),  # Gated DeltaNet
}
MLPS: dict[str, type[nn.Module]] = {
    "dense": DenseMLP,
    "sparse_moe": SparseMoE,
}  # each one's module, built as module(spec)


def kind_problems(kinds: list[LayerKind]) -> list[str]:
    """The layer kinds among `kinds` that no module here builds."""
    problems = []
    for what, table, names in (
        ("layer_types", MIXERS, [k.attention for k in kinds]),
        ("MLP kinds", MLPS, [k.mlp for k in kinds]),
    ):
        unknown = sorted(set(names) - set(table))
        if unknown:
            problems.append(f"{what} {unknown} are not supported (supported: {', '.join(table)})")
    return problems


class DecoderLayer(nn.Module):
    def __init__(self, s: LayerSpec, kind: LayerKind = LayerKind()) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden_size, s.eps)
        mixer = MIXERS[kind.attention]
        self.mixer_attribute, self.cache_kind = mixer.attribute, mixer.cache
        setattr(self, mixer.attribute, mixer.module(s, kind.attention))
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.eps)
        self.mlp = MLPS[kind.mlp](s)

    @property
    def mixer(self) -> nn.Module:
        return getattr(self, self.mixer_attribute)

    def forward(self, x: torch.Tensor, rope: Rope, cache: KVCache, attn: AttentionMetadata) -> torch.Tensor:
        """The residual stream in and out."""
        x = self.mixer(x, self.input_layernorm, rope, cache, attn)
        return self.mlp(x, self.post_attention_layernorm)

    def fold_norms(self) -> None:
        """Each norm's weight into the one GEMM that reads the norm's output (`fold_norm_weight`);
        an MoE MLP keeps its norm (`SparseMoE.fold_norm`)."""
        self.mixer.fold_norm(self.input_layernorm)
        self.mlp.fold_norm(self.post_attention_layernorm)


def decoder_stack(
    layers: nn.ModuleList,
    x: torch.Tensor,
    rope: Rope,
    caches: list[KVCache],
    attn: AttentionMetadata,
    norm: RMSNorm,
    capture: tuple[int, ...] = (),
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """`layers` then the final `norm`: the normed output, and the residual stream after each
    layer in `capture`."""
    captured = {}
    for i, (layer, cache) in enumerate(zip(layers, caches, strict=True)):
        x = layer(x, rope, cache, attn)
        if i in capture:
            captured[i] = x
    return norm(x), captured
