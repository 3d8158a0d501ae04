"""Rotary position embedding with the scaling variants of Hugging Face configs.

The inverse frequencies of scaled variants (linear, llama3, yarn) come from transformers'
own `ROPE_INIT_FUNCTIONS`, so a checkpoint's rope settings mean here what they mean there.
"""

from collections.abc import Callable

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from blockspec.layers.fast_path import cuda_compiled, fast_kernels
from blockspec.layers.kv_write import KVWrite, write_kv
from blockspec.layers.norm import rms_norm_ref

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(config) -> dict:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(params)
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def rotary_dim(config, head_dim: int) -> int:
    """The leading channels of each head that rotate (`partial_rotary_factor`: Qwen3.5, Qwen3-Next
    rotate a quarter); the rest pass through."""
    factor = rope_parameters(config).get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    return int(head_dim * (factor if factor is not None else 1.0))


def inv_freq_and_scale(config, head_dim: int) -> tuple[torch.Tensor, float]:
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if rope_type == "default":
        dim = rotary_dim(config, head_dim)
        exponent = torch.arange(0, dim, 2, dtype=torch.float) / dim
        return 1.0 / (params["rope_theta"] ** exponent), 1.0
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq.float(), float(scale)


class RotaryEmbedding(nn.Module):
    def __init__(self, config, head_dim: int) -> None:
        super().__init__()
        with torch.device("cpu"):  # real numbers even when the model is built on the meta device
            inv_freq, self.scale = inv_freq_and_scale(config, head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin tables for `positions` (any shape), each [..., head_dim]."""
        return rope_tables(positions, self.inv_freq, self.scale, dtype)


@cuda_compiled
def rope_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """On CUDA one launch for both tables (eager: nine, a forward's largest group of tiny ones)."""
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., heads, head_dim]; cos/sin: [..., rotary_dim] (broadcast over heads): the leading
    rotary_dim channels rotate, the rest pass through."""
    if cos.shape[-1] < x.shape[-1]:
        rot, rest = x.split([cos.shape[-1], x.shape[-1] - cos.shape[-1]], dim=-1)
        return torch.cat([apply_rotary(rot, cos, sin), rest], dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def norm_rope_ref(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Per-head RMSNorm (when weight is given: Qwen3's q/k norm), then rotary embedding."""
    return apply_rotary(rms_norm_ref(x, weight, eps) if weight is not None else x, cos, sin)


def qk_norm_rope_ref(
    qkv: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    kv_write: KVWrite | None = None,
    per_head: Callable = norm_rope_ref,
) -> torch.Tensor:
    """qkv [..., Hq + 2*Hkv, D] -> the same layout with the q and the k heads through `per_head`
    (`norm_rope_ref`) and the v heads as they are; with `kv_write` = (k_cache, v_cache,
    slot_mapping) the new k and v heads are also written to their cache slots (`write_kv`)."""
    q, k, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=-2)
    k = per_head(k, k_weight, eps, cos, sin)
    if kv_write is not None:
        write_kv(kv_write[0], kv_write[1], k, v, kv_write[2])
    return torch.cat([per_head(q, q_weight, eps, cos, sin), k, v], -2)


norm_rope = cuda_compiled(norm_rope_ref)


def qk_norm_rope(qkv: torch.Tensor, *args, kv_write: KVWrite | None = None) -> torch.Tensor:
    """`qk_norm_rope_ref`; on CUDA without grad one Triton launch that rewrites qkv in place and
    writes the cache, where the whole head rotates (partial rotary: the reference, its q and k
    each one compiled kernel)."""
    kernels = fast_kernels(qkv, "qk_norm_rope")
    if kernels is not None and args[3].shape[-1] == qkv.shape[-1]:  # args: q_weight, k_weight, eps, cos, ...
        return kernels.qk_norm_rope_triton(qkv, *args, kv_write=kv_write)
    return qk_norm_rope_ref(qkv, *args, kv_write=kv_write, per_head=norm_rope)


def layers_kv_write(
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    kv: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    groups: list[int],
) -> None:
    """Every layer's K and V from kv [L, ..., 2, Hkv, D] into its caches at its slots,
    slot_mapping[groups[i]] for layer i (slot_mapping [G, ...]: each cache group's): the k heads
    RMS-normed with the layer's row of k_weight [L, D] and rotated (`layers_k`), the v heads as they
    are (the DFlash drafter's context commit); on CUDA without grad one Triton launch for all layers
    instead of a norm + rope launch and a write per layer."""
    kernels = fast_kernels(kv, "qk_norm_rope")
    slots = [slot_mapping[g] for g in groups]
    if kernels is not None:
        return kernels.layers_kv_write_triton(caches, kv, k_weight, eps, cos, sin, slots)
    k = layers_k(kv, k_weight, eps, cos, sin)
    for i, (k_cache, v_cache) in enumerate(caches):
        write_kv(k_cache, v_cache, k[i], kv[i, ..., 1, :, :], slots[i])


def layers_k(
    kv: torch.Tensor, k_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """The k heads of kv [L, ..., 2, Hkv, D], each layer's normed with its row of k_weight [L, D]
    and rotated: [L, ..., Hkv, D]."""
    weight = k_weight.view(k_weight.shape[0], *[1] * (kv.dim() - 3), k_weight.shape[1])
    return norm_rope(kv[..., 0, :, :], weight, eps, cos, sin)
