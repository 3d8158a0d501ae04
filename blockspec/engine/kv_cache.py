"""Paged KV pools, recurrent state pools, and the state slots' allocator.

A layer's K/V pool has the pages of its cache group (`kv_cache_manager`): the target's and the
drafter's layers of one group use the same page ids, so one block table per group serves both.
Page 0 is never handed out: padding rows of a batch write their K/V there. A linear-attention
layer keeps a state per sequence instead, in the slot the sequence holds while it runs
(`SlotAllocator`); slot 0 is the padding sequences' trash slot."""

from collections import deque

import torch
from torch import nn

from blockspec.layers.decoder import PAGED_KV

KVCache = tuple[torch.Tensor, torch.Tensor]


def allocate_kv_cache(
    num_layers: int,
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[KVCache]:
    shape = (num_pages * page_size, num_kv_heads, head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]


def allocate_caches(
    layers: nn.ModuleList,
    num_pages: int | dict[str, int],
    page_size: int,
    num_slots: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[KVCache]:
    """Each decoder layer's cache, as its mixer keeps one (`DecoderLayer.cache_kind`): paged K/V
    pools of `num_pages` pages (per layer type: its cache group's), or a recurrent state per slot
    (conv state in `dtype`, the recurrence's state in fp32)."""
    caches = []
    for layer in layers:
        mixer = layer.mixer
        if layer.cache_kind == PAGED_KV:
            pages = num_pages if isinstance(num_pages, int) else num_pages[mixer.layer_type]
            caches += allocate_kv_cache(1, pages, page_size, mixer.num_kv_heads, mixer.head_dim, dtype, device)
        else:  # RECURRENT_STATE, the other kind (`decoder.MIXERS`)
            conv, state = mixer.cache_shapes
            caches.append(
                (
                    torch.zeros(num_slots, *conv, dtype=dtype, device=device),
                    torch.zeros(num_slots, *state, dtype=torch.float32, device=device),
                )
            )
    return caches


def kv_token_bytes(layers: nn.ModuleList, element_size: int) -> dict[str, int]:
    """Bytes a token's K/V takes in the paged layers, per layer type."""
    sizes: dict[str, int] = {}
    for layer in layers:
        if layer.cache_kind == PAGED_KV:
            mixer = layer.mixer
            sizes[mixer.layer_type] = (
                sizes.get(mixer.layer_type, 0) + 2 * mixer.num_kv_heads * mixer.head_dim * element_size
            )
    return sizes


def state_bytes(layers: nn.ModuleList, element_size: int) -> int:
    """Bytes a sequence's state takes in the layers that keep one (linear attention)."""
    total = 0
    for layer in layers:
        if layer.cache_kind != PAGED_KV:
            conv, state = layer.mixer.cache_shapes
            total += conv.numel() * element_size + state.numel() * 4
    return total


class SlotAllocator:
    """State slots 1 .. num_slots - 1, one per running sequence (slot 0: padding's)."""

    def __init__(self, num_slots: int) -> None:
        self.free_slots = deque(range(1, num_slots))

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    def allocate(self) -> int:
        return self.free_slots.popleft()

    def free(self, slot: int) -> None:
        self.free_slots.append(slot)
