"""Continuous batching: admit waiting sequences while KV pages (and state slots) last, give every
running sequence the pages its next step needs, and preempt (free and recompute later) the newest
sequences when pages run out. A preempted sequence keeps its tokens, so recomputing its KV
changes nothing in its output. A newcomer takes the full cache groups' pages of its whole prompt
at once; a windowed group's pages are taken chunk by chunk and step by step, as its window moves
(`kv_cache_manager`)."""

from collections import deque
from collections.abc import Callable

from blockspec.config import EngineConfig
from blockspec.engine.kv_cache import SlotAllocator
from blockspec.engine.kv_cache_manager import KVCacheManager
from blockspec.engine.sequence import Sequence, Status


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        kv_cache_manager: KVCacheManager,
        slots: SlotAllocator,
        span: Callable[[Sequence], int],
    ) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.slots = slots  # recurrent state slots, one per running sequence
        self.span = span  # positions the sequence's next step writes, from its anchor on
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self) -> list[Sequence]:
        """Move waiting sequences to running, holding the cached pages their prompt starts with
        (prefix caching); the rest of their prompt is prefilled in chunks (`prefill_chunks`).
        Under a backlog, newcomers wait until an eighth of the batch is free: a prefill is an
        eager forward costing several decoding steps, so one per finished sequence would
        dominate a full batch's time."""
        admitted, num_tokens = [], 0
        if not self.slots_open():
            return admitted
        reserved = self.reserved_pages()
        # Prompts being computed: one that starts as they do, with nothing cached yet, waits for
        # their pages instead of computing them again (a request's n choices, a shared system prompt).
        pages = self.kv_cache_manager
        computing = {pages.first_page_hash(s) for s in self.running if s.needs_prefill}
        while self.waiting and len(self.running) + len(admitted) < self.config.max_num_seqs:
            seq = self.waiting[0]
            # a prompt whose logprobs are asked is prefilled whole: a cached page holds no logits
            seq.num_cached = pages.match_prefix(seq) if seq.params.prompt_logprobs is None else 0
            num_prefill = seq.num_pending_prefill
            over_budget = admitted and num_tokens + num_prefill > self.config.max_num_batched_tokens
            first_page = pages.first_page_hash(seq)
            recomputes = seq.num_cached == 0 and first_page is not None and first_page in computing
            if over_budget or recomputes or not self.fits(seq, reserved):
                self.release(seq)  # the cached pages it would have held
                seq.num_cached = 0
                break
            pages.allocate(seq, self.first_step_tokens(seq), seq.num_cached)
            pages.count_lookup(seq)
            seq.state_slot = self.slots.allocate()
            seq.status = Status.RUNNING
            admitted.append(self.waiting.popleft())
            num_tokens += num_prefill
            computing.add(first_page)
        self.running.extend(admitted)
        return admitted

    def prefill_chunks(self) -> list[tuple[Sequence, int]]:
        """(sequence, tokens) to prefill before the next step: the running sequences' unprocessed
        prompt tokens, oldest first, in at most max_num_batched_tokens rows (the prefill pads each
        sequence to the longest chunk): chunked prefill, where a long prompt takes several steps and
        the running sequences decode between its chunks. Every sequence with unprocessed tokens
        counts, not only the newly admitted: after a failed prefill (e.g. out of memory) the next
        step redoes it. A chunk's windowed-group pages are taken here."""
        chunks, limit, longest = [], self.config.max_num_batched_tokens, 0
        for seq in self.running:
            if not seq.needs_prefill:
                continue
            n = min(seq.num_pending_prefill, limit)
            if seq.num_cached < seq.checkpoint_position:  # its states there are checkpointed
                n = min(n, seq.checkpoint_position - seq.num_cached)
            if chunks and (len(chunks) + 1) * max(longest, n) > limit:
                break
            if not self.kv_cache_manager.can_allocate(seq, seq.num_cached + n):
                break  # not while windowed pools are sized to their bound (`window_pool_pages`)
            self.kv_cache_manager.allocate(seq, seq.num_cached + n)
            longest = max(longest, n)
            chunks.append((seq, n))
        return chunks

    def admission_open(self) -> bool:
        """Whether admit() would take a newcomer now."""
        return self.slots_open() and self.fits(self.waiting[0], self.reserved_pages())

    def slots_open(self) -> bool:
        """Newcomers wait, and under a backlog until an eighth of the batch is free (see admit)."""
        free_slots = self.config.max_num_seqs - len(self.running)
        return bool(self.waiting) and free_slots >= min(len(self.waiting), max(1, self.config.max_num_seqs // 8))

    def reserved_pages(self) -> list[int]:
        """Pages of each group the running sequences need for their next step: not free for newcomers."""
        return self.kv_cache_manager.total_needed([(s, s.num_cached + self.span(s)) for s in self.running])

    def first_step_tokens(self, seq: Sequence) -> int:
        """Positions a newcomer's prefill and first step write."""
        return len(seq.token_ids) - 1 + self.span(seq)

    def fits(self, seq: Sequence, reserved: list[int]) -> bool:
        """Whether the pools hold a newcomer's prefill and first step beside the reserved pages
        (windowed groups: the pages it holds from the cache), and a state slot is free."""
        pages = self.kv_cache_manager
        needed = pages.pages_needed(seq, self.first_step_tokens(seq), seq.num_cached)
        free = pages.free_pages()
        return all(n <= f - r for n, f, r in zip(needed, free, reserved)) and self.slots.num_free > 0

    def allocate_ahead(self, seqs: list[Sequence], num_tokens: list[int]) -> bool:
        """Pages for a step launched before the one in flight is committed, or False (nothing
        allocated, nobody preempted) when the pool is short: the engine then completes the step in
        flight first and schedules as usual."""
        pages = self.kv_cache_manager
        needed = pages.total_needed(list(zip(seqs, num_tokens)))
        if any(n > f for n, f in zip(needed, pages.free_pages())):
            return False
        for s, n in zip(seqs, num_tokens):
            pages.allocate(s, n)
        return True

    def schedule_step(self) -> list[Sequence]:
        """Allocate the pages of every running sequence's next step, preempting from the
        newest end when the pool is short. Returns the sequences that step."""
        pending, scheduled = list(self.running), []
        while pending:
            seq = pending.pop(0)
            needed = seq.num_cached + self.span(seq)
            while not self.kv_cache_manager.can_allocate(seq, needed) and pending:
                self.preempt(pending.pop())
            if self.kv_cache_manager.can_allocate(seq, needed):
                self.kv_cache_manager.allocate(seq, needed)
                scheduled.append(seq)
            else:
                self.preempt(seq)
        self.running = scheduled
        return list(scheduled)  # a copy: finishing a sequence edits self.running

    def release(self, seq: Sequence) -> None:
        """Its pages and its state slot back to the pools."""
        self.kv_cache_manager.free(seq)
        seq.num_deferred = 0  # its deferred drafter context is lost with its pages: a prefill writes it again
        if seq.state_slot:
            self.slots.free(seq.state_slot)
            seq.state_slot = 0

    def preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self.release(seq)
        seq.num_cached = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self.release(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
