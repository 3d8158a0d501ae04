"""KV pages of every sequence, in cache groups, with prefix caching.

A cache group is a page pool that some layer types of the target and of the drafter keep their K/V
in (`CacheLayout`). Its `reach` is how many positions before a step's first row its layers read:
None for full attention, `sliding_window - 1` for a sliding layer, the drafter's context window.
A sequence has a block table per group, and the same position lives at the same table column in
every group. Pages of a windowed group that lie wholly before the reach are never read again:
they are released as the sequence advances (the tables show the trash page 0 there), so that
group's pool holds windows, not contexts, and its size is bounded (`window_pool_pages`).

Prefix caching: a page all of whose positions are computed is registered, in each group that
still holds it, under the hash of the tokens up to its end; a newcomer whose prompt starts with
registered pages holds them (reference counts) instead of computing them again. A hit of k pages
needs pages 0..k-1 in the full groups and, in a windowed group, the pages its reach reads before
position k * page_size. The drafter's context K/V sit in the same groups, so a hit brings them
along. A page no sequence holds keeps its K/V for reuse until its pool runs short (the least
recently freed goes first).

A linear-attention layer keeps no pages but one state per sequence, so on such a target a hit
also needs the states at its end: `StateCheckpoints` keeps copies of states at the end of cached
pages, taken where a prefill chunk ends on a page boundary, and a hit is as long as the longest
checkpointed prefix whose pages are held. A newcomer whose pages match further than any checkpoint
ends a prefill chunk where its match ends, so that the next prompt with that prefix finds it all
(the second request on a system prompt computes it, the third skips it)."""

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from blockspec.engine.sequence import Sequence
from blockspec.layers.decoder import PAGED_KV


@dataclass(frozen=True)
class CacheLayout:
    """The cache groups (by reach, full ones first) and the group of each layer type."""

    reaches: tuple[int | None, ...]  # per group: positions before a step's first row read (None: all)
    target: dict[str, int]  # target layer type -> group
    drafter: dict[str, int]  # drafter layer type -> group

    @classmethod
    def single(cls) -> "CacheLayout":
        """One group every attention layer shares."""
        every = {"full_attention": 0, "sliding_attention": 0}
        return cls((None,), every, every)

    @classmethod
    def of(cls, target: dict[str, int | None], drafter: dict[str, int | None]) -> "CacheLayout":
        """From the reach of each layer type that has layers, in the target and in the drafter."""
        reaches = tuple(sorted(set(target.values()) | set(drafter.values()), key=lambda r: -1 if r is None else r))
        group = {r: i for i, r in enumerate(reaches)}
        return cls(reaches, {t: group[r] for t, r in target.items()}, {t: group[r] for t, r in drafter.items()})


def window_reach(window: int | None, context: int | None = None) -> int | None:
    """The reach of a sliding layer (keys after p - window, for a row at p) under a context window
    (keys from the first row's position - context on; None: no limit)."""
    reaches = [r for r in (window - 1 if window is not None else None, context) if r is not None]
    return min(reaches) if reaches else None


def layer_reaches(layers, sliding_window: int | None, context: int | None = None) -> dict[str, int | None]:
    """The reach of each attention layer type among `layers`: the context window for full
    attention (None: the whole context), `window_reach` for sliding layers."""
    types = {layer.mixer.layer_type for layer in layers if layer.cache_kind == PAGED_KV}
    return {t: window_reach(sliding_window if t == "sliding_attention" else None, context) for t in types}


def window_pool_pages(reach: int, page_size: int, max_num_seqs: int, span: int, max_batched_tokens: int) -> int:
    """Pages a windowed group's pool needs so that it never runs short: each sequence holds at most
    its reach and two steps' positions (one in flight, one launched ahead), plus the pages of one
    step's prefill chunks, plus the trash page."""
    per_seq = -(-(reach + 2 * span) // page_size) + 1
    return 1 + max_num_seqs * (per_seq + 1) + -(-max_batched_tokens // page_size)


@dataclass
class BlockTable:
    """A sequence's pages in one group: pages[i] holds positions of table column first + i; the
    columns before `first` were released (out of the group's reach)."""

    pages: list[int] = field(default_factory=list)
    first: int = 0

    @property
    def end(self) -> int:
        """Columns covered, released ones included."""
        return self.first + len(self.pages)

    def page(self, column: int) -> int | None:
        return self.pages[column - self.first] if self.first <= column < self.end else None


@dataclass(frozen=True)
class PageKey:
    prefix_hash: bytes  # of the tokens from position 0 to the page's end (`page_key`)
    tokens: tuple[int, ...]  # the page's own (a hash match is checked against them)


def page_key(parent: bytes, tokens: tuple[int, ...]) -> PageKey:
    """SHA-256 of a page's tokens after its parent's hash (a cryptographic hash: a client cannot
    forge a prefix another's matches)."""
    return PageKey(hashlib.sha256(parent + array("q", tokens).tobytes()).digest(), tokens)


class PageAllocator:
    """One group's pool: free pages, reference counts, and its registered (cached) pages."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.num_usable = num_pages - 1  # all but the trash page
        self.free_pages = deque(range(1, num_pages))  # pages holding nothing reusable
        self.refs = [0] * num_pages  # sequences holding each page
        self.cached: dict[bytes, int] = {}  # prefix hash -> registered page
        self.keys: dict[int, PageKey] = {}  # registered page -> its key
        self.evictable: OrderedDict[int, None] = OrderedDict()  # registered pages no one holds, oldest first

    @property
    def num_free(self) -> int:
        return len(self.free_pages) + len(self.evictable)

    def pages_needed(self, table: BlockTable, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.page_size) - table.end)

    def allocate(self, table: BlockTable, num_tokens: int) -> None:
        """Grow the table in place to cover `num_tokens` positions."""
        for _ in range(self.pages_needed(table, num_tokens)):
            table.pages.append(self.take())

    def take(self) -> int:
        """A page for new K/V: a free one, else the registered page freed longest ago (evicted)."""
        if self.free_pages:
            page = self.free_pages.popleft()
        else:
            page, _ = self.evictable.popitem(last=False)
            del self.cached[self.keys.pop(page).prefix_hash]
        self.refs[page] = 1
        return page

    def drop(self, page: int) -> None:
        self.refs[page] -= 1
        if self.refs[page] == 0:
            if page in self.keys:
                self.evictable[page] = None
            else:
                self.free_pages.append(page)

    def free(self, table: BlockTable) -> None:
        """Release a sequence's pages; the tail first, so that the cache evicts a prefix's last
        pages before its first (a hit needs every page from position 0)."""
        for page in reversed(table.pages):
            self.drop(page)
        table.pages.clear()
        table.first = 0

    def num_before(self, table: BlockTable, column: int) -> int:
        """Pages the table holds before `column`."""
        return max(0, min(column - table.first, len(table.pages)))

    def releasable(self, table: BlockTable, column: int) -> int:
        """Pages that releasing the table's columns before `column` frees (held by it alone)."""
        return sum(self.refs[p] == 1 for p in table.pages[: self.num_before(table, column)])

    def release_before(self, table: BlockTable, column: int) -> None:
        """Release the table's pages of the columns before `column` (oldest first); the table
        then starts at `column` at the earliest."""
        released = self.num_before(table, column)
        for page in table.pages[:released]:
            self.drop(page)
        del table.pages[:released]
        table.first = max(table.first, column)

    def lookup(self, key: PageKey) -> int | None:
        page = self.cached.get(key.prefix_hash)
        return page if page is not None and self.keys[page] == key else None

    def hold(self, table: BlockTable, page: int) -> None:
        """Append a registered page to the table, held by one more sequence."""
        if self.refs[page] == 0:
            del self.evictable[page]
        self.refs[page] += 1
        table.pages.append(page)

    def register(self, key: PageKey, page: int) -> None:
        if key.prefix_hash not in self.cached:  # else another page computed the same prefix first
            self.cached[key.prefix_hash] = page
            self.keys[page] = key


class StateCheckpoints:
    """State slots that keep linear-attention states at the end of cached pages, by the page's
    prefix hash; when all are taken, the least recently used is given up."""

    def __init__(self, slots: range) -> None:
        self.free_slots = deque(slots)
        self.slots: OrderedDict[bytes, int] = OrderedDict()  # prefix hash -> slot, least recently used first

    def lookup(self, prefix_hash: bytes) -> int | None:
        slot = self.slots.get(prefix_hash)
        if slot is not None:
            self.slots.move_to_end(prefix_hash)
        return slot

    def take(self, prefix_hash: bytes) -> int | None:
        """A slot to copy the states at the end of this prefix into (None: they are kept already)."""
        if self.lookup(prefix_hash) is not None:
            return None
        slot = self.free_slots.popleft() if self.free_slots else self.slots.popitem(last=False)[1]
        self.slots[prefix_hash] = slot
        return slot


class KVCacheManager:
    """Every group's allocator, and each sequence's pages across them (`Sequence.block_tables`);
    with `checkpoints`, the linear-attention states at the end of cached pages."""

    def __init__(
        self,
        reaches: tuple[int | None, ...],
        num_pages: list[int],
        page_size: int,
        prefix_caching: bool,
        checkpoints: StateCheckpoints | None = None,
    ):
        self.reaches = reaches
        self.groups = [PageAllocator(n, page_size) for n in num_pages]
        self.page_size = page_size
        self.prefix_caching = prefix_caching
        self.checkpoints = checkpoints
        self.queries = self.hits = 0  # prompt tokens looked up in the cache, and found there

    @property
    def num_free(self) -> int:
        return sum(g.num_free for g in self.groups)

    @property
    def num_usable(self) -> int:
        return sum(g.num_usable for g in self.groups)

    def free_pages(self) -> list[int]:
        return [g.num_free for g in self.groups]

    def tables(self, seq: Sequence) -> list[BlockTable]:
        if not seq.block_tables:
            seq.block_tables = [BlockTable() for _ in self.groups]
        return seq.block_tables

    def targets(self, seq: Sequence, num_tokens: int, window_tokens: int | None) -> list[int]:
        """Positions each group's table must cover: `num_tokens`; in windowed groups at most
        `window_tokens` (None: num_tokens), their pages being taken as the positions come."""
        capped = min(num_tokens, window_tokens) if window_tokens is not None else num_tokens
        return [num_tokens if r is None else capped for r in self.reaches]

    def pages_needed(self, seq: Sequence, num_tokens: int, window_tokens: int | None = None) -> list[int]:
        """Pages each group must take to cover the positions (`targets`), less those `allocate`
        releases first."""
        ends = self.targets(seq, num_tokens, window_tokens)
        return [
            max(0, g.pages_needed(t, n) - g.releasable(t, self.first_read(seq.num_cached, reach)))
            for g, t, n, reach in zip(self.groups, self.tables(seq), ends, self.reaches)
        ]

    def total_needed(self, demands: list[tuple[Sequence, int]]) -> list[int]:
        """`pages_needed` of each (sequence, positions), summed per group."""
        total = [0] * len(self.groups)
        for seq, num_tokens in demands:
            total = [a + b for a, b in zip(total, self.pages_needed(seq, num_tokens))]
        return total

    def first_read(self, position: int, reach: int | None) -> int:
        """The first table column a group's layers read for rows from `position` on (None: all)."""
        return 0 if reach is None else max(0, position - reach) // self.page_size

    def can_allocate(self, seq: Sequence, num_tokens: int, window_tokens: int | None = None) -> bool:
        return all(n <= g.num_free for n, g in zip(self.pages_needed(seq, num_tokens, window_tokens), self.groups))

    def allocate(self, seq: Sequence, num_tokens: int, window_tokens: int | None = None) -> None:
        """Release the windowed groups' pages out of reach of the sequence's next rows (at
        num_cached on), then cover the positions (`targets`)."""
        ends = self.targets(seq, num_tokens, window_tokens)
        for g, t, n, reach in zip(self.groups, self.tables(seq), ends, self.reaches):
            g.release_before(t, self.first_read(seq.num_cached, reach))
            g.allocate(t, n)

    def free(self, seq: Sequence) -> None:
        for g, t in zip(self.groups, seq.block_tables):
            g.free(t)
        seq.page_hashes.clear()
        seq.checkpoint_position = 0

    def first_page_hash(self, seq: Sequence) -> bytes | None:
        """The key a prompt's first page would be cached under (None: no whole page, or no cache)."""
        if not self.prefix_caching or len(seq.token_ids) - 1 < self.page_size:
            return None
        return next(self.page_keys(seq, 0, 1)).prefix_hash

    def page_keys(self, seq: Sequence, first: int, stop: int):
        """The keys of the sequence's pages first .. stop - 1, in order (a generator; the pages
        before `first` are hashed in seq.page_hashes)."""
        parent = seq.page_hashes[first - 1] if first else b""
        for i in range(first, stop):
            key = page_key(parent, tuple(seq.token_ids[i * self.page_size : (i + 1) * self.page_size]))
            parent = key.prefix_hash
            yield key

    def match_prefix(self, seq: Sequence) -> int:
        """Give a sequence with no pages the registered pages its prompt starts with (whole pages,
        before the anchor; with checkpoints, up to the last checkpointed one), held as its own in
        every group; returns the positions they cover, now computed (with checkpoints, once the
        states are restored: `restore_slot`)."""
        tables = self.tables(seq)
        if not self.prefix_caching:
            return 0
        keys, found = [], []  # found[i][j]: group j's page of keys[i]
        for key in self.page_keys(seq, 0, (len(seq.token_ids) - 1) // self.page_size):
            pages = [g.lookup(key) for g in self.groups]
            if any(p is None for p, r in zip(pages, self.reaches) if r is None):  # full groups: every page
                break
            keys.append(key)
            found.append(pages)
        k = next(k for k in range(len(keys), -1, -1) if self.windows_hold(found, k))
        if self.checkpoints is not None:
            held = k
            k = next(k for k in range(held, -1, -1) if k == 0 or self.restorable(keys, found, k))
            seq.checkpoint_position = held * self.page_size if held > k else 0
        for j, (g, t, reach) in enumerate(zip(self.groups, tables, self.reaches)):
            t.first = self.first_read(k * self.page_size, reach)
            for i in range(t.first, k):
                g.hold(t, found[i][j])
        seq.page_hashes = [key.prefix_hash for key in keys[:k]]
        return k * self.page_size

    def restorable(self, keys: list[PageKey], found: list[list[int | None]], k: int) -> bool:
        """Whether a hit of k pages can resume: the states at its end are checkpointed, and the
        windowed groups hold the pages read after it."""
        return self.windows_hold(found, k) and self.checkpoints.lookup(keys[k - 1].prefix_hash) is not None

    def restore_slot(self, seq: Sequence) -> int | None:
        """The checkpoint holding the states at the end of an admitted sequence's cached prefix
        (None: no checkpoints, or nothing cached)."""
        if self.checkpoints is None or not seq.page_hashes:
            return None
        slot = self.checkpoints.lookup(seq.page_hashes[-1])
        assert slot is not None, "match_prefix hits only checkpointed prefixes, and admission takes none"
        return slot

    def checkpoint_slot(self, seq: Sequence) -> int | None:
        """Where to copy a sequence's states after a prefill chunk: a checkpoint now kept for its
        computed prefix, where that ends on a registered page (None: no checkpoints, not a page
        boundary, or kept already)."""
        n = seq.num_cached // self.page_size
        if self.checkpoints is None or seq.num_cached % self.page_size or not 0 < n <= len(seq.page_hashes):
            return None
        return self.checkpoints.take(seq.page_hashes[n - 1])

    def windows_hold(self, found: list[list[int | None]], k: int) -> bool:
        """Whether every windowed group holds the pages its rows after k pages read."""
        return all(
            all(found[i][j] is not None for i in range(self.first_read(k * self.page_size, r), k))
            for j, r in enumerate(self.reaches)
            if r is not None
        )

    def count_lookup(self, seq: Sequence) -> None:
        """Count an admitted sequence's prompt lookup (a lookup undone by a failed admission is not)."""
        self.queries += len(seq.token_ids) - 1
        self.hits += seq.num_cached

    def register(self, seq: Sequence) -> None:
        """Register the sequence's pages whose every position is computed (below num_cached), in
        each group that holds them; not yet those holding positions whose drafter context is
        deferred (a sequence sharing them would draft from context never written)."""
        if not self.prefix_caching:
            return
        first = len(seq.page_hashes)
        complete = (seq.num_cached - seq.num_deferred) // self.page_size
        for i, key in enumerate(self.page_keys(seq, first, complete), first):
            seq.page_hashes.append(key.prefix_hash)
            for g, t in zip(self.groups, seq.block_tables):
                if (page := t.page(i)) is not None:
                    g.register(key, page)
