"""Attention over a paged KV cache: the reference path (plain PyTorch), used on CPU and as
the oracle for fast kernels.

A cache is `[num_slots, kv_heads, head_dim]` per layer for K and for V, where slot =
page * page_size + offset. A sequence's pages are listed in its row of `block_tables`.
Two kinds of forward use it:
- causal (target prefill/verify): the new K/V are written to their slots first, then the
  queries attend to the sequence's cache under the mask;
- block (drafter propose): the new K/V are scratch; queries attend to the cached context
  followed by the block's own K/V, never written.
Which positions are visible is decided once per forward by `AttentionMetadata.mask`.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    block_tables: torch.Tensor  # [B, M] page ids, padded with the trash page 0
    page_size: int
    masks: dict[str, torch.Tensor]  # layer type -> [B, 1, S, M*page (+S for block)], True = visible
    slot_mapping: torch.Tensor | None  # [B, S] slots of the new K/V; None: new K/V are block scratch

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor],
        layer_type: str,
        scale: float,
    ) -> torch.Tensor:
        """q: [B, S, Hq, D]; k, v: [B, S, Hkv, D]; returns [B, S, Hq, D]."""
        k_cache, v_cache = cache
        if self.slot_mapping is not None:
            write_kv(k_cache, v_cache, k, v, self.slot_mapping)
        k_all, v_all = (
            gather_kv(k_cache, self.block_tables, self.page_size),
            gather_kv(v_cache, self.block_tables, self.page_size),
        )
        if self.slot_mapping is None:
            k_all, v_all = torch.cat([k_all, k], dim=1), torch.cat([v_all, v], dim=1)
        return sdpa(q, k_all, v_all, self.masks[layer_type], scale)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [B, S, Hq, D]; k, v: [B, L, Hkv, D]; mask: [B, 1, S, L]; returns [B, S, Hq, D]."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.transpose(1, 2)


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    slots = slot_mapping.reshape(-1)
    k_cache.index_copy_(0, slots, k.reshape(-1, *k.shape[-2:]).to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.reshape(-1, *v.shape[-2:]).to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, page_size: int) -> torch.Tensor:
    """[B, M*page_size, Hkv, D]: each sequence's pages laid end to end."""
    pages = cache.view(-1, page_size, *cache.shape[1:])[block_tables]
    return pages.flatten(1, 2)


def visibility(
    q_pos: torch.Tensor, k_pos: torch.Tensor, k_valid: torch.Tensor, causal: bool, window: int | None
) -> torch.Tensor:
    """[B, 1, S, L] mask: key j is visible to query i when it is valid and, for causal
    attention, not after i; with a window, only the last `window` positions are seen."""
    qp, kp = q_pos[:, :, None], k_pos[:, None, :]
    mask = k_valid[:, None, :].expand(-1, q_pos.shape[1], -1)
    if causal:
        mask = mask & (kp <= qp)
    if window is not None:
        mask = mask & (qp - kp < window)
    return mask[:, None]


@dataclass
class DenseAttention:
    """Attention without a paged cache (training, reference checks): the keys are the new
    K/V, preceded by dense context K/V when a layer's `cache` is a (k, v) pair [B, T, Hkv, D]."""

    masks: dict[str, torch.Tensor]  # layer type -> [B, 1, S, T+S] (or [B, 1, S, S] without context)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor] | None,
        layer_type: str,
        scale: float,
    ) -> torch.Tensor:
        if cache is not None:
            k, v = torch.cat([cache[0], k], dim=1), torch.cat([cache[1], v], dim=1)
        return sdpa(q, k, v, self.masks[layer_type], scale)
