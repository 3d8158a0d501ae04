"""Where a forward's new K/V reach the paged caches (`[num_slots, kv_heads, head_dim]` per layer for
K and for V, `blockspec.layers.attention`).

A layer's write target is a `KVWrite` (its caches and this step's slots, `AttentionMetadata.kv_write`).
`write_kv` is the one reference write; the rest call it on the CPU, with grad on and under
`reference_ops`. On CUDA the write rides in the launch that makes the new keys:
- the step's attention (`kernels.paged_attention.qkv_attention_triton`, through
  `AttentionMetadata.attend_qkv`), for steps whose rows fit one query tile;
- the q/k norm + rope of other steps (`rotary.qk_norm_rope`, `kernels.qk_norm_rope.qk_norm_rope_triton`);
- the drafter's context commit, every layer at once (`rotary.layers_kv_write`,
  `kernels.qk_norm_rope.layers_kv_write_triton`)."""

import torch

KVWrite = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (k_cache, v_cache, slot_mapping)


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v [..., Hkv, D] into the caches [slots, Hkv, D] at slot_mapping [...]."""
    slots = slot_mapping.reshape(-1)
    k_cache.index_copy_(0, slots, k.reshape(-1, *k.shape[-2:]).to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.reshape(-1, *v.shape[-2:]).to(v_cache.dtype))
