"""Runs the target and the proposer on a batch of sequences: host inputs to the device, the
prefill, and the decoding step (`engine.step.step_forward`), eagerly or as CUDA graph replays."""

import functools
from dataclasses import replace

import numpy as np
import torch

from blockspec.engine.batch import causal_range, key_ranges, make_batch
from blockspec.engine.cuda_graphs import GraphCache
from blockspec.engine.kv_cache import KVCache
from blockspec.engine.kv_cache_manager import CacheLayout
from blockspec.engine.sequence import Sequence
from blockspec.engine.step import StepInputs, flush_forward, propose_forward, row_logprob, step_forward
from blockspec.layers.attention import AttentionMetadata
from blockspec.layers.decoder import RECURRENT_STATE
from blockspec.layers.recurrent_state import RecurrentStates
from blockspec.models.causal_lm import CausalLM
from blockspec.penalties import PenaltyState, penalty_row
from blockspec.proposers.base import Proposer
from blockspec.sampling import MAX_STOP_IDS, sampling_row, token_logprobs

# The step inputs a flush does not read, emptied so that one flush graph serves every step kind
FLUSH_UNREAD = {
    "sampling": None,
    "filters": False,
    "logprobs": False,
    "min_positions": None,
    "stop_ids": None,
    "penalties": None,
    "bitmask": None,
    "q": None,
}
PROMPT_LOGPROB_ROWS = 256  # prompt rows whose logits a prefill computes at once (prompt_logprobs)


class ModelRunner:
    def __init__(
        self,
        target: CausalLM,
        proposer: Proposer | None,
        target_cache: list[KVCache],
        drafter_cache: list[KVCache] | None,
        page_size: int,
        graphs: GraphCache | None = None,
        max_model_len: int = 2**62,
        layout: CacheLayout | None = None,
    ) -> None:
        self.target, self.proposer = target, proposer
        self.target_cache, self.drafter_cache = target_cache, drafter_cache
        self.page_size = page_size
        self.layout = layout or CacheLayout.single()  # which cache group each layer type's K/V are in
        self.graphs = graphs
        self.max_model_len = max_model_len  # positions a drafter block may write stay below it
        self.device = target.lm_head.weight.device
        self.capture = proposer.capture_layers if proposer is not None else ()
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.phase_marks = None  # benchmarks: an object whose record(name) marks a step's phases
        self.penalty_state: PenaltyState | None = None  # allocated with the first request with logit rules
        # [state slots, R, C]: per sequence, the target features (C: the proposer's layers') of up to
        # R positions whose drafter context width-1 steps deferred (`step.defer_context`); None: none are
        self.deferred: torch.Tensor | None = None
        self.reports_chances = False  # steps report each draft's chance of acceptance (`step.Verdict`)

    @property
    def vocab_size(self) -> int:
        """Columns of the target's logits."""
        return self.target.lm_head.weight.shape[0]

    def reset_penalties(self, seq: Sequence, num_slots: int) -> None:
        """The penalty state's row of a sequence with logit rules (`SamplingParams.logit_rules`), from its
        tokens (at admission)."""
        if self.penalty_state is None:
            self.penalty_state = PenaltyState.allocate(num_slots, self.vocab_size, self.device)
        self.penalty_state.reset(seq.state_slot, seq.token_ids[: seq.num_prompt_tokens], seq.output_token_ids)

    def tensor(self, data: list | np.ndarray) -> torch.Tensor:
        """Host integers on the device. On CUDA copied on a stream of its own, which the current one
        waits for: a step launched ahead is queued while the step before runs, and its inputs then
        cross during that step instead of after it, between the two steps' graphs."""
        host = torch.as_tensor(np.asarray(data, dtype=np.int64))
        if self.device.type != "cuda":
            return host
        with torch.cuda.stream(self.copy_stream):  # allocated there, so no pending kernel still reads the memory
            device = host.pin_memory().to(self.device, non_blocking=True)
        current = torch.cuda.current_stream()
        current.wait_stream(self.copy_stream)
        device.record_stream(current)  # not reused before the current stream is done with it
        return device

    def to_host(self, *xs: torch.Tensor | None) -> tuple[list[torch.Tensor | None], torch.cuda.Event | None]:
        """Start copying each x (None: none) to the host; the copies are complete once the event
        (None on the CPU) passed."""
        if self.device.type != "cuda":  # an x may be a graph's output, which its next replay overwrites
            return [x.clone() if x is not None else None for x in xs], None
        hosts = [torch.empty(x.shape, dtype=x.dtype, pin_memory=True) if x is not None else None for x in xs]
        for host, x in zip(hosts, xs):
            if x is not None:
                host.copy_(x, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return hosts, ready

    def tensors(self, *arrays: list | np.ndarray) -> list[torch.Tensor]:
        """Host integer arrays to the device in one copy (each copy adds its latency to a step's
        critical path), as views of it, each 16-byte aligned (as kernels specialize) and none at
        offset 0 or 1 (torch.compile specializes those: each would be another compile). Filled
        in place: np.pad and np.concatenate cost more host time than the copy."""
        host = [np.asarray(a, dtype=np.int64) for a in arrays]
        starts = np.cumsum([2] + [h.size + h.size % 2 for h in host])  # even lengths after 2 spare
        flat = np.zeros(starts[-1], np.int64)
        for h, start in zip(host, starts):
            flat[start : start + h.size] = h.ravel()
        device = self.tensor(flat)
        return [device[start : start + h.size].view(h.shape) for h, start in zip(host, starts)]

    def host_block_tables(self, seqs: list[Sequence]) -> np.ndarray:
        """[B, G, M] page ids per cache group, the trash page where a sequence holds none (released
        or past its pages), M the most columns a sequence covers: the host cost and the copy follow
        the pages in use, not the context limit."""
        width = max(t.end for s in seqs for t in s.block_tables)
        tables = np.zeros((len(seqs), len(self.layout.reaches), width), dtype=np.int64)
        for rows, s in zip(tables, seqs):
            for row, t in zip(rows, s.block_tables):
                row[t.first : t.end] = t.pages
        return tables

    def copy_state(self, src: int, dst: int) -> None:
        """A state slot's linear-attention states into another slot (prefix caching's checkpoints)."""
        for layer, cache in zip(self.target.layers, self.target_cache):
            if layer.cache_kind == RECURRENT_STATE:
                for pool in cache:
                    pool[dst].copy_(pool[src])

    def num_graphs(self) -> int:
        """CUDA graphs captured so far (a capture synchronizes the device and compiles)."""
        return len(self.graphs.graphs) if self.graphs is not None else 0

    def mark(self, phase: str) -> None:
        """The end of a step's phase, for benchmarks that time them (`phase_marks`)."""
        if self.phase_marks is not None:
            self.phase_marks.record(phase)

    def target_forward(
        self,
        input_ids: torch.Tensor,
        starts: torch.Tensor,
        lengths: torch.Tensor,
        block_tables: torch.Tensor,
        states: RecurrentStates,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target's final hidden states and its context features (the proposer's layers);
        `states`: where its linear-attention layers' states are, and when they are written."""
        b = make_batch(starts, lengths, block_tables, input_ids.shape[1], self.page_size)
        ranges = key_ranges(b, causal_range(b.positions), self.target.sliding_window)
        attn = AttentionMetadata(
            b.block_tables, b.slot_mapping, self.layout.target, ranges, self.page_size, b.starts, states
        )
        return self.target(input_ids, b.positions, attn, self.target_cache, self.capture)

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence], num_tokens: list[int] | None = None) -> None:
        """Process the next num_tokens[i] of each sequence's tokens before its anchor (a chunk of
        them; None: all); fills target KV and the proposer's context."""
        num_tokens = num_tokens or [s.num_pending_prefill for s in seqs]
        tokens = [s.token_ids[s.num_cached : s.num_cached + n] for s, n in zip(seqs, num_tokens)]
        lengths = [len(t) for t in tokens]
        width = max(lengths)
        ids, starts, lengths_t, tables, slots = self.tensors(
            [t + [0] * (width - len(t)) for t in tokens],
            [s.num_cached for s in seqs],
            lengths,
            self.host_block_tables(seqs),
            [s.state_slot for s in seqs],
        )
        states = RecurrentStates(slots, starts, lengths_t)
        hidden, features = self.target_forward(ids, starts, lengths_t, tables, states)  # eager: prompt shapes vary
        if self.proposer is not None:
            self.proposer.commit(self, features, starts, lengths_t, tables)
        for i, s in enumerate(seqs):
            if s.params.prompt_logprobs is not None:
                self.prompt_logprobs(s, hidden[i], lengths[i])
        for s, n in zip(seqs, lengths):
            s.num_cached += n

    def prompt_logprobs(self, seq: Sequence, hidden: torch.Tensor, num_rows: int) -> None:
        """Append the log-probabilities of the prompt tokens this prefill's rows (hidden [S, H], the
        first num_rows real, from position num_cached on) predict and the sequence lacks (row p
        predicts token p + 1; a recomputed prefix already has them), PROMPT_LOGPROB_ROWS rows at a
        time: a long chunk's logits would not fit at once."""
        first = max(seq.num_cached, len(seq.prompt_logprobs))
        last = min(seq.num_cached + num_rows, seq.num_prompt_tokens - 1)
        for lo in range(first, last, PROMPT_LOGPROB_ROWS):
            hi = min(lo + PROMPT_LOGPROB_ROWS, last)
            logits = self.target.compute_logits(hidden[lo - seq.num_cached : hi - seq.num_cached])
            tokens = seq.token_ids[lo + 1 : hi + 1]
            rows = token_logprobs(logits, self.tensor(tokens)).tolist()
            seq.prompt_logprobs += [row_logprob(t, row, seq.params.prompt_logprobs) for t, row in zip(tokens, rows)]

    def step_inputs(
        self,
        seqs: list[Sequence],
        widths: list[int],
        anchors: torch.Tensor | None,
        starts: torch.Tensor | None,
        host_drafts: list[list[int]] | None = None,
        bitmask: np.ndarray | None = None,
        q: torch.Tensor | None = None,
        backlog: list[int] | None = None,
    ) -> StepInputs:
        """A decoding step's inputs, the host's part in one copy. Row 0 of each block is its anchor:
        `anchors` [B, 1] on the device (a step launched ahead passes them, and `starts`, while the
        step before still computes them), else the host's, followed by `host_drafts` where they
        were made before the step (q: their distributions). `starts` None: the committed lengths.
        bitmask: the rows' grammar masks (`structured_output.token_bitmasks`), None: no grammar.
        backlog: `StepInputs.backlog`, None: the step commits its drafter context."""
        width = max(widths)
        arrays = [widths, self.host_block_tables(seqs), [s.seed for s in seqs], [s.state_slot for s in seqs]]
        if backlog is not None:
            arrays.append(backlog)
        if starts is None:
            arrays.append([s.num_cached for s in seqs])
        if host_drafts is not None:
            arrays.append([[s.anchor, *d] + [0] * (width - 1 - len(d)) for s, d in zip(seqs, host_drafts)])
        elif anchors is None:
            arrays.append([[s.anchor] for s in seqs])
        sampled = not all(s.params.greedy for s in seqs)
        if sampled:  # float32 parameters crossing bitwise, two to an int64
            rows = np.asarray([sampling_row(s.params) for s in seqs], dtype=np.float32)
            arrays.append(rows.view(np.int64))
        # a step launched ahead: its sequences may have fewer tokens than num_generated says
        ruled = any(s.params.penalized or s.num_generated < s.params.min_tokens for s in seqs)
        if ruled:  # float32 penalties crossing bitwise, as the sampling parameters; min_tokens' bans
            rows = np.asarray([penalty_row(s.params) for s in seqs], dtype=np.float32)
            arrays.append(rows.view(np.int64))
            arrays.append([s.num_prompt_tokens + s.params.min_tokens for s in seqs])
            banned = [s.stop_ids if s.params.min_tokens else [] for s in seqs]
            arrays.append([ids + [-1] * (MAX_STOP_IDS - len(ids)) for ids in banned])
        if bitmask is not None:  # int32 words crossing bitwise, two to an int64
            arrays.append(bitmask.view(np.int64))
        lengths, tables, seeds, slots, *rest = self.tensors(*arrays)
        backlog = rest.pop(0) if backlog is not None else None
        bitmask = rest.pop().view(torch.int32) if bitmask is not None else None
        min_positions, stop_ids = (rest.pop(-2), rest.pop()) if ruled else (None, None)
        penalty_rows = rest.pop() if ruled else None
        sampling = rest.pop() if sampled else None
        tokens = rest.pop() if anchors is None else anchors
        tokens = tokens.expand(-1, width)  # a device proposer reads column 0; the width sets the rows
        starts = rest.pop() if starts is None else starts
        filters = sampled and any(s.params.filtered for s in seqs if not s.params.greedy)
        logprobs = any(s.params.logprobs is not None for s in seqs)
        return StepInputs(
            tokens, starts, lengths, tables, seeds, slots, sampling, filters, logprobs, min_positions, stop_ids,
            penalty_rows, bitmask, q, backlog,
        )  # fmt: skip

    @torch.inference_mode()
    def propose(self, inputs: StepInputs, widths: list[int]) -> tuple[list[list[int]], torch.Tensor | None]:
        """The proposer's drafts for a step, made before it (`propose_forward`; a CUDA graph replay
        when graphs are on): each sequence's on the host (at most widths[i] - 1, fewer where the
        proposer cuts them), and their distributions q [B, >= w-1, V] on the device (None: no row
        is sampled; a graph's may have a row more: the caller cuts it). The proposer reads none of
        the step's logprobs, min_tokens and penalties inputs: its graphs go without them."""
        inputs = replace(inputs, logprobs=False, min_positions=None, stop_ids=None, penalties=None)
        fn = functools.partial(propose_forward, self)
        packed, q = fn(inputs) if self.graphs is None else self.graphs.run("propose+" + inputs.mode, fn, inputs)
        return [r[1 : 1 + r[0]] for r in packed.tolist()], q

    @torch.inference_mode()
    def flush(self, inputs: StepInputs) -> None:
        """`flush_forward` on the inputs (a CUDA graph replay when graphs are on); it reads their
        positions, pages, state slots and backlog only: one graph serves every step kind. It
        replays between a step and the step launched ahead from that one's outputs, so its graph
        has a memory pool of its own."""
        inputs = replace(inputs, **FLUSH_UNREAD)
        fn = functools.partial(flush_forward, self)
        if self.graphs is None:
            fn(inputs)
        else:
            self.graphs.run("flush", fn, inputs, own_pool=True)

    @torch.inference_mode()  # the ops' CUDA fast paths (argmax among them) run without grad
    def step(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`step_forward` on the inputs, as a CUDA graph replay when graphs are on."""
        fn = functools.partial(step_forward, self)
        if self.graphs is None:
            return fn(inputs)
        return self.graphs.run(inputs.mode, fn, inputs)
