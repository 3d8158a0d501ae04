"""The decoder layer that targets and drafters share: a token mixer (attention), then a SwiGLU MLP,
each a pre-norm block over the residual stream whose norm runs in the GEMM after it and whose
residual add runs in the GEMM before it (`blockspec.layers.linear`). q/k/v and gate/up are packed
into one projection each (`packed_parts`), so that each is one GEMM.

A layer's kind (`LayerKind`) names its mixer and its MLP. `MIXERS` and `MLPS` hold the modules of
the kinds built so far, and the cache a mixer keeps per sequence: a new kind (linear attention with
its recurrent state, an MoE MLP) is a module and an entry there."""

from dataclasses import dataclass

import torch
from torch import nn

from blockspec.layers.attention import AttentionMetadata
from blockspec.layers.linear import Linear
from blockspec.layers.moe import MoESpec, SparseMoE
from blockspec.layers.norm import RMSNorm, fold_norm_weight

KVCache = tuple[torch.Tensor, torch.Tensor]
Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin
Packing = dict[str, list[tuple[str, int]]]  # packed projection -> its checkpoint parts and their rows, in order
PAGED_KV = "paged_kv"  # K/V of every position in the paged pools


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


@dataclass(frozen=True)
class LayerKind:
    """What one layer is: its token mixer, named as Hugging Face's `layer_types` name it (full or
    sliding-window attention), and its MLP."""

    attention: str = "full_attention"
    mlp: str = "dense"

    @property
    def cache(self) -> str:
        """What the layer keeps of each sequence between steps (`MIXERS`)."""
        return MIXERS[self.attention][1]


def packed_parts(s: LayerSpec) -> Packing:
    """Each packed projection's checkpoint parts, in order, and the rows of each."""
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    return {
        "qkv_proj": [("q_proj", q), ("k_proj", kv), ("v_proj", kv)],
        "gate_up_proj": [("gate_proj", s.intermediate_size), ("up_proj", s.intermediate_size)],
    }


def weight(norm: RMSNorm | None) -> torch.Tensor | None:
    return norm.weight if norm is not None else None


class Attention(nn.Module):
    def __init__(self, s: LayerSpec, layer_type: str) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = s.num_heads, s.num_kv_heads, s.head_dim
        self.layer_type = layer_type
        self.q_size, self.kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        self.qkv_proj = Linear(s.hidden_size, self.q_size + 2 * self.kv_size, bias=s.qkv_bias)  # q|k|v: one GEMM
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
        heads, norms = (self.num_heads, self.num_kv_heads), (weight(self.q_norm), weight(self.k_norm))
        out = attn.attend_qkv(
            qkv, norms, self.eps, rope, heads, cache, self.layer_type, self.head_dim**-0.5, self.sinks
        )
        return self.o_proj(out.flatten(-2), residual=x if residual else None)


class MLP(nn.Module):
    def __init__(self, s: LayerSpec) -> None:
        super().__init__()
        self.gate_up_proj = Linear(s.hidden_size, 2 * s.intermediate_size, bias=s.mlp_bias)  # gate|up: one GEMM
        self.down_proj = Linear(s.intermediate_size, s.hidden_size, bias=s.mlp_bias)

    def forward(self, x: torch.Tensor, norm: RMSNorm | None, residual: bool = True) -> torch.Tensor:
        """x + mlp(norm(x)) (without `residual`: mlp(norm(x))): the norm and SwiGLU run in the gate|up
        GEMM, the add in the down GEMM."""
        return self.down_proj(self.gate_up_proj(x, norm=norm, swiglu=True), residual=x if residual else None)

    def fold_norm(self, norm: RMSNorm) -> None:
        fold_norm_weight(norm, self.gate_up_proj)


# Each mixer kind: its module, built as module(spec, kind), and the cache it keeps per sequence.
MIXERS: dict[str, tuple[type[nn.Module], str]] = {
    "full_attention": (Attention, PAGED_KV),
    "sliding_attention": (Attention, PAGED_KV),  # keys of the last `sliding_window` positions
}
MLPS: dict[str, type[nn.Module]] = {"dense": MLP, "sparse_moe": SparseMoE}  # each one's module, built as module(spec)


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
        self.self_attn = MIXERS[kind.attention][0](s, kind.attention)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.eps)
        self.mlp = MLPS[kind.mlp](s)

    def forward(self, x: torch.Tensor, rope: Rope, cache: KVCache, attn: AttentionMetadata) -> torch.Tensor:
        """The residual stream in and out."""
        x = self.self_attn(x, self.input_layernorm, rope, cache, attn)
        return self.mlp(x, self.post_attention_layernorm)

    def fold_norms(self) -> None:
        """Each norm's weight into the one GEMM that reads the norm's output (`fold_norm_weight`);
        an MoE MLP keeps its norm (`SparseMoE.fold_norm`)."""
        fold_norm_weight(self.input_layernorm, self.self_attn.qkv_proj)
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
