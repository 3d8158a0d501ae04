"""Paged KV pools and the page allocator.

The target's and the drafter's pools have the same number of pages and a sequence uses the
same page ids in both, so one block table serves both caches. Page 0 is never handed out:
padding rows of a batch write their K/V there."""

from collections import deque

import torch

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
