"""The DFlash drafter (published `DFlashDraftModel` layout): Qwen3 decoder layers whose
attention sees the target's context through K/V injection, a block of
[anchor, MASK, ...] rows attending bidirectionally, and the target's embedding and LM head.

Context K/V: for each committed position t, c[t] = hidden_norm(fc(feat[t])) and every layer's
K = rope(k_norm(k_proj(c))), V = v_proj(c). All layers read the same c, so their k/v
projections are stacked into one weight and computed with one GEMM (`fused_kv`)."""

import dataclasses

import torch
from torch import nn

from blockspec.layers.attention import AttentionMetadata
from blockspec.layers.linear import Linear, linear
from blockspec.layers.norm import RMSNorm
from blockspec.layers.rotary import RotaryEmbedding, layers_k, layers_kv_write
from blockspec.models.llama import DecoderLayer, KVCache, decoder_stack, layer_spec, layer_types, sliding_window


def dflash_value(config, name: str, default=None):
    """A DFlash field: `dflash_config` first, then the top level (both forms are published)."""
    dflash = getattr(config, "dflash_config", None) or {}
    return dflash.get(name, getattr(config, name, default))


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Evenly spaced from layer 1 to layer L-3 (one drafter layer: L // 2); distinct and in
    range for small targets too."""
    if num_draft_layers == 1 or num_target_layers < 3:
        return [num_target_layers // 2]
    start, end = 1, max(1, num_target_layers - 3)
    span = end - start
    return sorted({round(start + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)})


class DFlashDrafter(nn.Module):
    def __init__(self, config, num_target_layers: int, target_hidden_size: int) -> None:
        super().__init__()
        self.config = config
        self.spec = dataclasses.replace(layer_spec(config), qk_norm=True)
        n = config.num_hidden_layers
        self.layer_types = layer_types(config)
        self.sliding_window = sliding_window(config)
        self.layers = nn.ModuleList(DecoderLayer(self.spec, t) for t in self.layer_types)
        ids = dflash_value(config, "target_layer_ids")
        self.target_layer_ids = tuple(ids if ids is not None else default_target_layer_ids(num_target_layers, n))
        h = self.spec.hidden_size
        self.fc = Linear(len(self.target_layer_ids) * target_hidden_size, h, bias=False)
        self.hidden_norm = RMSNorm(h, self.spec.eps)
        self.norm = RMSNorm(h, self.spec.eps)
        self.rotary = RotaryEmbedding(config, self.spec.head_dim)
        self.block_size = int(dflash_value(config, "block_size", 16))
        self.mask_token_id = dflash_value(config, "mask_token_id")
        self.input_embedding_scale = float(dflash_value(config, "input_embedding_scale", 1.0))
        self.output_multiplier = float(dflash_value(config, "output_multiplier", 1.0))
        self.logit_softcap = dflash_value(config, "final_logit_softcapping")

    def fuse_kv(self) -> None:
        """Stack every layer's k/v projection (rows [K0; V0; K1; V1; ...]) and k_norm weight.
        Call after the weights are loaded."""
        attns = [layer.self_attn for layer in self.layers]
        q = attns[0].q_size  # qkv_proj rows are q | k | v: the k|v rows are the tail
        self.fused_kv_weight = torch.cat([a.qkv_proj.weight[q:] for a in attns])
        biased = attns[0].qkv_proj.bias is not None
        self.fused_kv_bias = torch.cat([a.qkv_proj.bias[q:] for a in attns]) if biased else None
        self.k_norm_weight = torch.stack([a.k_norm.weight for a in attns])  # [L, D]
        self.fused_kv_fp8 = None  # an Fp8Linear of the same rows once quantize_drafter ran

    def context_rows(self, features: torch.Tensor) -> torch.Tensor:
        """Every layer's context k and v heads before k's norm and rope, [L, *lead, 2, Hkv, D] (a
        view of one GEMM's output), from features [*lead, n*H_t]."""
        s = self.spec
        c = self.fc(features)  # hidden_norm(c) is the fused K/V GEMM's prologue
        fp8 = self.fused_kv_fp8
        if fp8 is not None:
            kv = fp8(c, norm=self.hidden_norm)
        else:
            kv = linear(c, self.fused_kv_weight, self.fused_kv_bias, norm=self.hidden_norm)
        return kv.view(*c.shape[:-1], len(self.layers), 2, s.num_kv_heads, s.head_dim).movedim(-4, 0)

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's context K and V, each [L, *positions.shape, Hkv, D], from features
        [*positions.shape, n*H_t] in one GEMM. Differentiable when `fuse_kv` ran under autograd."""
        kv = self.context_rows(features)
        k = layers_k(kv, self.k_norm_weight, self.spec.eps, *self.rotary(positions, kv.dtype))
        return k, kv[..., 1, :, :]

    def write_context(
        self, features: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, kv_caches: list[KVCache]
    ) -> None:
        """Append context K/V for committed positions. features: [N, n*H_t]; positions, slots: [N]."""
        kv = self.context_rows(features)
        rope = self.rotary(positions, kv.dtype)
        layers_kv_write(kv_caches, kv, self.k_norm_weight, self.spec.eps, *rope, slot_mapping)

    def forward(
        self, embeds: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata, kv_caches: list[KVCache]
    ) -> torch.Tensor:
        """embeds: the target's embedding of the block rows [B, S, H]; returns normed hidden."""
        x = embeds * self.input_embedding_scale
        rope = self.rotary(positions, x.dtype)
        return decoder_stack(self.layers, x, rope, kv_caches, attn, self.norm)[0]

    def compute_logits(self, hidden: torch.Tensor, target: nn.Module) -> torch.Tensor:
        """Logits through the target's LM head, or its FP8 copy (`quantize_drafter`), in the head's
        dtype; in fp32 where the config scales or caps them."""
        fp8 = getattr(self, "lm_head_fp8", None)
        logits = fp8(hidden) if fp8 is not None else target.compute_logits(hidden)
        if self.output_multiplier != 1.0:
            logits = logits.float() * self.output_multiplier
        if self.logit_softcap:
            logits = torch.tanh(logits.float() / self.logit_softcap) * self.logit_softcap
        return logits
