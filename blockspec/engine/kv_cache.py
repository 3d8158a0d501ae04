"""Paged KV pools, recurrent state pools, and their allocators.

The target's and the drafter's pools have the same number of pages and a sequence uses the
same page ids in both, so one block table serves both caches. Page 0 is never handed out:
padding rows of a batch write their K/V there. A linear-attention layer keeps a state per
sequence instead, in the slot the sequence holds while it runs (`SlotAllocator`); slot 0 is the
padding sequences' trash slot."""

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
    num_pages: int,
    page_size: int,
    num_slots: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[KVCache]:
    """Each decoder layer's cache, as its mixer keeps one (`DecoderLayer.cache_kind`): paged K/V
    pools, or a recurrent state per slot (conv state in `dtype`, the recurrence's state in fp32)."""
    caches = []
    for layer in layers:
        mixer = layer.mixer
        if layer.cache_kind == PAGED_KV:
            shape = (mixer.num_kv_heads, mixer.head_dim)
            caches += allocate_kv_cache(1, num_pages, page_size, *shape, dtype, device)
        else:  # RECURRENT_STATE, the other kind (`decoder.MIXERS`)
            conv, state = mixer.cache_shapes
            caches.append(
                (
                    torch.zeros(num_slots, *conv, dtype=dtype, device=device),
                    torch.zeros(num_slots, *state, dtype=torch.float32, device=device),
                )
            )
    return caches


def cache_bytes(layers: nn.ModuleList, element_size: int) -> tuple[int, int]:
    """(bytes a token's K/V takes in the paged layers, bytes a sequence's state takes in the others)."""
    per_token = per_slot = 0
    for layer in layers:
        mixer = layer.mixer
        if layer.cache_kind == PAGED_KV:
            per_token += 2 * mixer.num_kv_heads * mixer.head_dim * element_size
        else:
            conv, state = mixer.cache_shapes
            per_slot += conv.numel() * element_size + state.numel() * 4
    return per_token, per_slot


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


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.num_usable = num_pages - 1  # all but the trash page
        self.free_pages = deque(range(1, num_pages))

    @property
    def num_free(self) -> int:
        return len(self.free_pages)

    def pages_needed(self, block_table: list[int], num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.page_size) - len(block_table))

    def can_allocate(self, block_table: list[int], num_tokens: int) -> bool:
        return self.pages_needed(block_table, num_tokens) <= self.num_free

    def allocate(self, block_table: list[int], num_tokens: int) -> None:
        """Grow block_table in place to cover `num_tokens` positions."""
        for _ in range(self.pages_needed(block_table, num_tokens)):
            block_table.append(self.free_pages.popleft())

    def free(self, block_table: list[int]) -> None:
        self.free_pages.extend(block_table)
        block_table.clear()
