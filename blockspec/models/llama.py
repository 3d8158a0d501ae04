"""Decoder-only targets of the Llama family: Llama, Qwen2 and Qwen3 differ only in biases
and the per-head q/k RMSNorm, so one model class reads all three from their HF configs.
Parameter names are Hugging Face's, except that q/k/v and gate/up are packed into one projection
each (`loading.weights.pack`), so that each is one GEMM."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.layers.attention import AttentionMetadata
from blockspec.layers.fast_path import cuda_compiled
from blockspec.layers.linear import Linear
from blockspec.layers.norm import RMSNorm, fold_norm_weight
from blockspec.layers.rotary import RotaryEmbedding
from blockspec.sampling import is_int

embedding = cuda_compiled(F.embedding)  # on CUDA a fused gather: aten's took 6.6 µs for a block's 16 rows (H200)

KVCache = tuple[torch.Tensor, torch.Tensor]
FAMILIES = ("llama", "qwen2", "qwen3")
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class LayerSpec:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool


def packed_sizes(s: LayerSpec) -> dict[str, list[int]]:
    """Rows of each part of the packed projections (q|k|v, gate|up)."""
    return {
        "qkv_proj": [s.num_heads * s.head_dim] + [s.num_kv_heads * s.head_dim] * 2,
        "gate_up_proj": [s.intermediate_size] * 2,
    }


def layer_spec(config) -> LayerSpec:
    family = config.model_type
    if family not in FAMILIES:
        raise ValueError(f"model_type {family!r} is not supported (supported: {', '.join(FAMILIES)})")
    act = getattr(config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"hidden_act {act!r} is not supported (the MLP is SwiGLU: silu only)")
    bias = bool(getattr(config, "attention_bias", False))
    return LayerSpec(
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        num_kv_heads=num_kv_heads(config),
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        intermediate_size=config.intermediate_size,
        eps=config.rms_norm_eps,
        qkv_bias=True if family == "qwen2" else bias,
        o_bias=bias if family != "qwen2" else False,
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        qk_norm=family == "qwen3",
    )


def num_kv_heads(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def layer_types(config) -> list[str]:
    """Each layer's attention, as transformers lays them out (`layer_types`; Qwen2/Qwen3 with
    use_sliding_window slide from max_window_layers on): full causal, or over the last
    `sliding_window` positions."""
    return list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)


def sliding_window(config) -> int | None:
    """The window of the sliding layers; None where no layer slides."""
    return config.sliding_window if "sliding_attention" in layer_types(config) else None


def config_problems(config) -> list[str]:
    """What a target's or drafter's config asks for that its layers cannot do: query heads that
    do not share the K/V heads evenly, unknown layer types, sliding layers without a window."""
    heads, kv_heads, problems = config.num_attention_heads, num_kv_heads(config), []
    if heads % kv_heads:
        problems.append(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    types = layer_types(config)
    unknown = sorted({t for t in types if t not in LAYER_TYPES})
    if unknown:
        problems.append(f"layer_types {unknown} are not supported (supported: {', '.join(LAYER_TYPES)})")
    window = getattr(config, "sliding_window", None)
    if "sliding_attention" in types and not (is_int(window) and window > 0):
        problems.append(f"sliding_attention layers need a positive sliding_window, got {window!r}")
    return problems


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
        self.q_norm = RMSNorm(s.head_dim, s.eps) if s.qk_norm else None  # Qwen3 only
        self.k_norm = RMSNorm(s.head_dim, s.eps) if s.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        norm: RMSNorm,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache,
        attn: AttentionMetadata,
    ) -> torch.Tensor:
        """x + attention(norm(x)): the norm runs in the qkv GEMM, the add in the o GEMM."""
        qkv = self.qkv_proj(x, norm=norm).view(*x.shape[:-1], -1, self.head_dim)
        heads, norms = (self.num_heads, self.num_kv_heads), (weight(self.q_norm), weight(self.k_norm))
        out = attn.attend_qkv(qkv, norms, self.eps, rope, heads, cache, self.layer_type, self.head_dim**-0.5)
        return self.o_proj(out.flatten(-2), residual=x)


class MLP(nn.Module):
    def __init__(self, s: LayerSpec) -> None:
        super().__init__()
        self.gate_up_proj = Linear(s.hidden_size, 2 * s.intermediate_size, bias=s.mlp_bias)  # gate|up: one GEMM
        self.down_proj = Linear(s.intermediate_size, s.hidden_size, bias=s.mlp_bias)

    def forward(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """x + mlp(norm(x)): the norm and SwiGLU run in the gate|up GEMM, the add in the down GEMM."""
        return self.down_proj(self.gate_up_proj(x, norm=norm, swiglu=True), residual=x)


class DecoderLayer(nn.Module):
    def __init__(self, s: LayerSpec, layer_type: str = "full_attention") -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden_size, s.eps)
        self.self_attn = Attention(s, layer_type)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.eps)
        self.mlp = MLP(s)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: KVCache, attn: AttentionMetadata
    ) -> torch.Tensor:
        """The residual stream in and out; each norm is fused into the GEMM after it and each
        residual add into the GEMM before it (`blockspec.layers.linear`)."""
        x = self.self_attn(x, self.input_layernorm, rope, cache, attn)
        return self.mlp(x, self.post_attention_layernorm)


def decoder_stack(
    layers: nn.ModuleList,
    x: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    kv_caches: list[KVCache],
    attn: AttentionMetadata,
    norm: RMSNorm,
    capture: tuple[int, ...] = (),
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """`layers` then the final `norm`: the normed output, and the residual stream after each
    layer in `capture`."""
    captured = {}
    for i, (layer, cache) in enumerate(zip(layers, kv_caches, strict=True)):
        x = layer(x, rope, cache, attn)
        if i in capture:
            captured[i] = x
    return norm(x), captured


class Backbone(nn.Module):
    def __init__(self, config, s: LayerSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(s, t) for t in layer_types(config))
        self.norm = RMSNorm(s.hidden_size, s.eps)


class CausalLM(nn.Module):
    """Target model. `forward` returns the final hidden states and the concatenated
    residual-stream outputs of the layers in `capture` (the drafter's context features)."""

    def __init__(self, config) -> None:
        super().__init__()
        problems = config_problems(config)
        if problems:
            raise ValueError("; ".join(problems))
        self.config = config
        self.sliding_window = sliding_window(config)
        self.spec = layer_spec(config)
        self.model = Backbone(config, self.spec)
        self.lm_head = Linear(self.spec.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(config, self.spec.head_dim)

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    @property
    def norms_folded(self) -> bool:
        """`fold_norms` ran (it folds every layer at once: the first tells; the engine asks every step)."""
        return len(self.layers) > 0 and self.layers[0].input_layernorm.weight is None

    def fold_norms(self) -> None:
        """Each layer's two RMSNorm weights into the GEMM after it (q|k|v, gate|up), so the GEMMs
        that fuse the norm skip its multiply (`fold_norm_weight`; H200, 16 rows: q|k|v 16.9 against
        15.0 µs without the multiply, gate|up 51.4 against 48.6). The final norm keeps its weight:
        its output is the drafter's feature, and a tied LM head is the embedding."""
        for layer in self.model.layers:
            fold_norm_weight(layer.input_layernorm, layer.self_attn.qkv_proj)
            fold_norm_weight(layer.post_attention_layernorm, layer.mlp.gate_up_proj)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return embedding(input_ids, self.model.embed_tokens.weight)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the LM head's dtype: the greedy argmax reads them as they are (an fp32 copy of
        a verify's [16, 151936] cost a launch of 9 µs on the H200), sampling converts them."""
        return self.lm_head(hidden)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: list[KVCache],
        capture: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = self.embed(input_ids)
        rope = self.rotary(positions, x.dtype)
        hidden, captured = decoder_stack(self.model.layers, x, rope, kv_caches, attn, self.model.norm, capture)
        captured[len(self.model.layers) - 1] = hidden  # HF's hidden_states[L] (what drafters train on) is normed
        features = torch.cat([captured[i] for i in capture], dim=-1) if capture else None
        return hidden, features
