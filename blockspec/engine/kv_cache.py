"""Paged KV pools, recurrent state pools, and their allocators.

The target's and the drafter's pools have the same number of pages and a sequence uses the
same page ids in both, so one block table serves both caches. Page 0 is never handed out:
padding rows of a batch write their K/V there. A linear-attention layer keeps a state per
sequence instead, in the slot the sequence holds while it runs (`SlotAllocator`); slot 0 is the
padding sequences' trash slot.

Prefix caching (`PageAllocator`): a page all of whose positions are computed is registered under
the hash of the tokens up to its end; a newcomer whose prompt starts with registered pages holds
them (reference counts) instead of computing them again. As both pools share page ids, a hit
brings the drafter's context K/V of those positions along with the target's. A page no sequence
holds keeps its K/V for reuse until the pool runs short (the least recently freed goes first)."""

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass

import torch
from torch import nn

from blockspec.engine.sequence import Sequence
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


@dataclass(frozen=True)
class PageKey:
    prefix_hash: bytes  # of the tokens from position 0 to the page's end (`PageAllocator.page_hash`)
    tokens: tuple[int, ...]  # the page's own (a hash match is checked against them)


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int, prefix_caching: bool = False) -> None:
        self.page_size = page_size
        self.num_usable = num_pages - 1  # all but the trash page
        self.free_pages = deque(range(1, num_pages))  # pages holding nothing reusable
        self.prefix_caching = prefix_caching
        self.refs = [0] * num_pages  # sequences holding each page
        self.cached: dict[bytes, int] = {}  # prefix hash -> registered page
        self.keys: dict[int, PageKey] = {}  # registered page -> its key
        self.evictable: OrderedDict[int, None] = OrderedDict()  # registered pages no one holds, oldest first
        self.queries = self.hits = 0  # prompt tokens looked up in the cache, and found there

    @property
    def num_free(self) -> int:
        return len(self.free_pages) + len(self.evictable)

    def pages_needed(self, block_table: list[int], num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.page_size) - len(block_table))

    def can_allocate(self, block_table: list[int], num_tokens: int) -> bool:
        return self.pages_needed(block_table, num_tokens) <= self.num_free

    def allocate(self, block_table: list[int], num_tokens: int) -> None:
        """Grow block_table in place to cover `num_tokens` positions."""
        for _ in range(self.pages_needed(block_table, num_tokens)):
            block_table.append(self.take())

    def take(self) -> int:
        """A page for new K/V: a free one, else the registered page freed longest ago (evicted)."""
        if self.free_pages:
            page = self.free_pages.popleft()
        else:
            page, _ = self.evictable.popitem(last=False)
            del self.cached[self.keys.pop(page).prefix_hash]
        self.refs[page] = 1
        return page

    def free(self, block_table: list[int]) -> None:
        """Release a sequence's pages; the tail first, so that the cache evicts a prefix's last
        pages before its first (a hit needs every page from position 0)."""
        for page in reversed(block_table):
            self.refs[page] -= 1
            if self.refs[page] == 0:
                if page in self.keys:
                    self.evictable[page] = None
                else:
                    self.free_pages.append(page)
        block_table.clear()

    def page_key(self, seq: Sequence, i: int) -> PageKey:
        """Page i of the sequence's tokens: its tokens, and SHA-256 of them after the hash of the
        pages before it (a cryptographic hash: a client cannot forge a prefix another's matches)."""
        tokens = tuple(seq.token_ids[i * self.page_size : (i + 1) * self.page_size])
        parent = seq.page_hashes[i - 1] if i else b""
        return PageKey(hashlib.sha256(parent + array("q", tokens).tobytes()).digest(), tokens)

    def first_page_hash(self, seq: Sequence) -> bytes | None:
        """The key a prompt's first page would be cached under (None: no whole page, or no cache)."""
        if not self.prefix_caching or len(seq.token_ids) - 1 < self.page_size:
            return None
        return self.page_key(seq, 0).prefix_hash

    def match_prefix(self, seq: Sequence) -> int:
        """Give a sequence with no pages the registered pages its prompt starts with (whole pages,
        before the anchor), held as its own; returns the positions they cover, now computed."""
        if not self.prefix_caching:
            return 0
        num_pages = (len(seq.token_ids) - 1) // self.page_size
        for i in range(num_pages):
            key = self.page_key(seq, i)
            page = self.cached.get(key.prefix_hash)
            if page is None or self.keys[page] != key:
                break
            if self.refs[page] == 0:
                del self.evictable[page]
            self.refs[page] += 1
            seq.block_table.append(page)
            seq.page_hashes.append(key.prefix_hash)
        return len(seq.block_table) * self.page_size

    def count_lookup(self, seq: Sequence) -> None:
        """Count an admitted sequence's prompt lookup (a lookup undone by a failed admission is not)."""
        self.queries += len(seq.token_ids) - 1
        self.hits += seq.num_cached

    def register(self, seq: Sequence) -> None:
        """Register the sequence's pages whose every position is computed (below num_cached)."""
        if not self.prefix_caching:
            return
        for i in range(len(seq.page_hashes), seq.num_cached // self.page_size):
            key = self.page_key(seq, i)
            seq.page_hashes.append(key.prefix_hash)
            if key.prefix_hash not in self.cached:  # else another page computed the same prefix first
                self.cached[key.prefix_hash] = seq.block_table[i]
                self.keys[seq.block_table[i]] = key
