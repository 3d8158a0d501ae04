"""The engine: requests in, steps of batched speculative decoding, outputs out. The LLM
facade and the HTTP server both drive it through add_request / step / abort."""

import logging
import secrets
import threading
import time
from dataclasses import dataclass, replace

import torch

from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.engine.adaptive import RUN_AHEAD_RUN, AdaptiveWidth, width_classes
from blockspec.engine.cuda_graphs import GraphCache
from blockspec.engine.detokenizer import append_text, find_stop
from blockspec.engine.kv_cache import SlotAllocator, allocate_caches, kv_token_bytes, state_bytes
from blockspec.engine.kv_cache_manager import (
    CacheLayout,
    KVCacheManager,
    StateCheckpoints,
    layer_reaches,
    window_pool_pages,
)
from blockspec.engine.runner import ModelRunner
from blockspec.engine.scheduler import Scheduler
from blockspec.engine.sequence import Sequence, fresh_request_id
from blockspec.engine.step import LaunchedStep, StepOutput, finish_step, launch_step
from blockspec.engine.step_costs import step_costs
from blockspec.engine.warm_up import warm_up
from blockspec.layers.decoder import RECURRENT_STATE
from blockspec.layers.fast_path import restore_kernels, use_kernels
from blockspec.layers.gated_deltanet import fla_kernels
from blockspec.layers.kernels import kernel_module
from blockspec.layers.moe import SparseMoE
from blockspec.loading.hf import Target
from blockspec.models.registry import Drafter
from blockspec.outputs import CompletionOutput, RequestMetrics, RequestOutput
from blockspec.proposers import DRAFTER_PROPOSERS
from blockspec.proposers.base import Proposer
from blockspec.proposers.ngram import NgramProposer
from blockspec.proposers.simulated import SimulatedProposer
from blockspec.sampling import MAX_STOP_IDS, InvalidSamplingParam, SamplingParams
from blockspec.structured_output import Grammars, StructuredOutput, xgrammar_installed

log = logging.getLogger(__name__)
CPU_KV_BUDGET = 2 * 2**30  # bytes of KV pools when num_pages is not given
GPU_KV_FRACTION = 0.5  # of free device memory
NGRAM_DRAFTS = 7  # default drafts per step of the n-gram proposer


@dataclass
class Flight:
    """A launched step and what the adaptive width policy learns from it."""

    step: LaunchedStep
    chosen: int | None  # the width the policy chose (None: it did not choose)
    launched: float  # wall clock at launch
    timed: bool  # False: its time is not a measure of its width (a prefill or a capture ran in it)
    before: int | None = None  # launched ahead: the width class of the step committed in its time


@dataclass
class StepRecord:
    """A committed step, as `LLMEngine.step_log` keeps it for benchmarks: when the host had its
    results (wall clock), the widest block it ran, the sequences it ran, and whether its time is a
    measure of its width (as the adaptive policy's timings: no prefill or capture fell in it, and
    none of its sequences had finished before it was read)."""

    completed: float
    width: int
    batch: int
    timed: bool


def check_row_invariance(model: torch.nn.Module) -> None:
    """EngineConfig.row_invariant's targets: not those with linear-attention layers, nor those with
    MoE layers on CUDA (the expert kernel's tiles follow each expert's rows); on CUDA, with triton
    (torch's CUDA scans and reductions pick their order by the shape)."""
    unsupported = "linear-attention" if any(layer.cache_kind == RECURRENT_STATE for layer in model.layers) else None
    cuda = model.lm_head.weight.is_cuda
    if cuda and any(isinstance(layer.mlp, SparseMoE) for layer in model.layers):
        unsupported = unsupported or "MoE (on CUDA)"
    if unsupported is not None:
        raise ValueError(f"row_invariant: not supported for targets with {unsupported} layers")
    if cuda and kernel_module("paged_attention") is None:
        raise ValueError("row_invariant on CUDA runs Triton kernels: pip install triton")


class LLMEngine:
    def __init__(
        self, target: Target, drafter: Drafter | None, spec: SpeculativeConfig | None, config: EngineConfig
    ) -> None:
        if config.row_invariant:
            check_row_invariance(target.model)
        self.kernels = use_kernels(config.engine_kernels)
        if config.fold_norms is not None and config.fold_norms != target.model.norms_folded:
            raise ValueError(
                f"fold_norms={config.fold_norms} is a load option: this target was loaded with its norms "
                f"{'folded' if target.model.norms_folded else 'unfolded'} (loading.finish.target_options)"
            )
        self.target, self.drafter, self.config = target, drafter, config
        self.tokenizer = target.tokenizer
        model = target.model
        self.device = model.lm_head.weight.device
        self.vocab_size = model.config.vocab_size
        self.max_model_len = min(config.max_model_len or 2**62, model.config.max_position_embeddings)
        if config.max_model_len is not None and config.max_model_len > self.max_model_len:
            log.warning(
                "max_model_len %d is more than the model's context (max_position_embeddings): %d it is",
                config.max_model_len, self.max_model_len,
            )  # fmt: skip
        self.recurrent = any(layer.cache_kind == RECURRENT_STATE for layer in model.layers)
        if self.device.type == "cuda" and self.recurrent:
            fla_kernels()  # now, not at the first request: what to install, if they are missing
        prefix_caching = config.prefix_caching is not False
        self.num_checkpoints = (
            (config.state_checkpoints or config.max_num_seqs) if prefix_caching and self.recurrent else 0
        )
        self.max_width, self.proposer = self.speculation(spec)
        drafter_reaches = self.proposer.cache_reaches() if self.proposer is not None else {}
        self.layout = CacheLayout.of(layer_reaches(model.layers, model.sliding_window), drafter_reaches)
        num_pages = self.group_pages()
        pages_per_seq = -(-self.max_model_len // config.page_size)  # a step writes positions < max_model_len
        full = [n for n, r in zip(num_pages, self.layout.reaches) if r is None]
        if full and full[0] - 1 < pages_per_seq:
            raise ValueError(
                f"{full[0]} KV pages of {config.page_size} tokens cannot hold one sequence of "
                f"max_model_len {self.max_model_len}: raise num_pages or lower max_model_len"
            )
        caches = [self.caches(m, num_pages, groups) for m, groups in self.cached_models()]
        target_cache, drafter_cache = caches if len(caches) == 2 else (caches[0], None)
        adaptive = spec is not None and spec.adaptive_width and self.max_width > 1
        row_classes = width_classes(self.max_width) if adaptive else (self.max_width,)
        graphs = (
            GraphCache(config.max_num_seqs, pages_per_seq, row_classes)
            if self.device.type == "cuda" and config.cuda_graphs
            else None
        )
        self.runner = ModelRunner(
            model, self.proposer, target_cache, drafter_cache, config.page_size, graphs, self.max_model_len, self.layout
        )
        if adaptive and drafter_cache is not None and spec.deferred_context:
            features = len(self.proposer.capture_layers) * model.spec.hidden_size
            shape = (self.num_slots, spec.deferred_context, features)
            self.runner.deferred = torch.zeros(shape, dtype=self.dtype, device=self.device)
        checkpoints = StateCheckpoints(range(self.num_slots, self.num_state_slots)) if self.num_checkpoints else None
        pages = KVCacheManager(self.layout.reaches, num_pages, config.page_size, prefix_caching, checkpoints)
        self.scheduler = Scheduler(config, pages, SlotAllocator(self.num_slots), self.span)
        self.requests: dict[str, Sequence] = {}
        # Launching a step before the one in flight reaches the host needs the next anchors on the
        # device: true of the drafter and plain decoding, not of the n-gram proposer (host tokens).
        run_ahead = config.async_steps if config.async_steps is not None else self.device.type == "cuda"
        self.run_ahead = run_ahead and (self.proposer is None or self.proposer.on_device)
        # Steps run ahead share their time with their neighbours' host work: runs (`adaptive`)
        run_length = RUN_AHEAD_RUN if self.run_ahead else 1
        # On CUDA a bucket's first step of a width captures its graph or compiles: it times nothing.
        captures = self.device.type == "cuda"
        self.adaptive = AdaptiveWidth(self.max_width, run_length, captures) if adaptive else None
        self.runner.reports_chances = adaptive  # its rates learn from each draft's chance, not its 0/1 outcome
        self.in_flight: Flight | None = None
        self.grammars: Grammars | None = None  # made at the first structured request
        self.grammars_made = threading.Lock()  # `structured_outputs` runs on any thread
        self.last_completion = 0.0
        self.step_log: list[StepRecord] | None = None  # a list: every committed step is appended
        if graphs is not None and config.warm_up:
            grammar = self.tokenizer is not None and self.structured_proposer and xgrammar_installed()
            warm_up(
                self.runner, config.max_num_seqs, config.max_num_batched_tokens, self.step_rows, self.num_slots, grammar
            )
        if self.adaptive is not None and config.warm_up and self.proposer.on_device:
            # Without graphs (a CPU) a larger bucket's step takes seconds: those are timed on live steps.
            buckets = graphs.buckets if graphs is not None else [1]
            self.adaptive.start_from(step_costs(self.runner, buckets, row_classes, self.step_rows, self.run_ahead))

    def speculation(self, spec: SpeculativeConfig | None) -> tuple[int, Proposer | None]:
        """The widest block a step verifies (anchor + drafts) and the proposer of the drafts (None:
        plain decoding)."""
        drafter = self.drafter
        if drafter is not None:
            n = spec.num_speculative_tokens if spec.num_speculative_tokens is not None else drafter.num_drafts
            if n > drafter.num_drafts:
                raise ValueError(
                    f"num_speculative_tokens {n} is more than the drafter proposes: its block of "
                    f"{drafter.block_size} rows makes at most {drafter.num_drafts} drafts a step"
                )
            proposer = DRAFTER_PROPOSERS[drafter.proposer].from_config(drafter, spec)
            if spec.simulate_tau is not None:
                proposer = SimulatedProposer(proposer, spec.simulate_tau, n)
            return n + 1, proposer
        if spec is not None and spec.method == "ngram":
            n = spec.num_speculative_tokens if spec.num_speculative_tokens is not None else NGRAM_DRAFTS
            return n + 1, NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        return 1, None

    @property
    def dtype(self) -> torch.dtype:
        return self.target.model.lm_head.weight.dtype

    @property
    def num_slots(self) -> int:
        """A recurrent-state slot per running sequence, and the trash slot 0."""
        return self.config.max_num_seqs + 1

    @property
    def num_state_slots(self) -> int:
        """Slots of the recurrent-state pools: the sequences' (`num_slots`), then prefix caching's
        checkpoints."""
        return self.num_slots + self.num_checkpoints

    def caches(self, model, num_pages: list[int], groups: dict[str, int]) -> list:
        pages = {layer_type: num_pages[g] for layer_type, g in groups.items()}
        return allocate_caches(
            model.layers, pages, self.config.page_size, self.num_state_slots, self.dtype, self.device
        )

    def cached_models(self) -> list[tuple[torch.nn.Module, dict[str, int]]]:
        """The target, and the drafter where its proposer keeps its context K/V, each with the
        cache group of each of its layer types."""
        models = [(self.target.model, self.layout.target)]
        return models + ([(self.drafter, self.layout.drafter)] if self.layout.drafter else [])

    def page_bytes(self) -> list[int]:
        """Bytes of a KV page of each cache group, the target's and the drafter's layers together."""
        sizes = [0] * len(self.layout.reaches)
        for model, groups in self.cached_models():
            for layer_type, n in kv_token_bytes(model.layers, self.dtype.itemsize).items():
                sizes[groups[layer_type]] += n * self.config.page_size
        return sizes

    def group_pages(self) -> list[int]:
        """Pages of each cache group's pool: a windowed group's bound (`window_pool_pages`); the
        full groups' `num_pages`, by default what the cache budget holds beside the windowed pools
        and the recurrent states."""
        c = self.config
        windowed = [
            window_pool_pages(r, c.page_size, c.max_num_seqs, self.step_rows, c.max_num_batched_tokens)
            if r is not None
            else 0
            for r in self.layout.reaches
        ]
        full = c.num_pages or self.default_num_pages(windowed)
        return [n if r is not None else full for n, r in zip(windowed, self.layout.reaches)]

    def default_num_pages(self, windowed: list[int]) -> int:
        """Pages of the full groups that the cache budget holds (at most max_num_seqs contexts)."""
        wanted = self.config.max_num_seqs * -(-self.max_model_len // self.config.page_size) + 1
        if self.device.type == "cuda":
            budget = torch.cuda.mem_get_info(self.device)[0] * GPU_KV_FRACTION
        else:
            budget = CPU_KV_BUDGET
        states = sum(state_bytes(m.layers, self.dtype.itemsize) for m, _ in self.cached_models()) * self.num_state_slots
        sizes = self.page_bytes()
        windows = sum(n * size for n, size in zip(windowed, sizes))
        if states + windows >= budget:
            held = f"max_num_seqs {self.config.max_num_seqs} sequences"
            held += f" and {self.num_checkpoints} state_checkpoints" if self.num_checkpoints else ""
            parts = [f"the recurrent states of {held}"] * bool(states)
            parts += ["the windows of its windowed cache groups"] * bool(windows)
            lower = "max_num_seqs" + " or state_checkpoints" * bool(self.num_checkpoints)
            raise ValueError(
                f"{' and '.join(parts)} take {(states + windows) / 2**30:.1f} GiB, more than the cache budget "
                f"({budget / 2**30:.1f} GiB): lower {lower}"
            )
        full_page = sum(size for size, r in zip(sizes, self.layout.reaches) if r is None)
        return max(2, min(wanted, int((budget - states - windows) // full_page))) if full_page else 2

    def width(self, seq: Sequence, ahead: int = 0) -> int:
        """Most rows the next step may verify: anchor + drafts, never past max_tokens or the
        context. `ahead`: rows of a step in flight, counted as if all were committed. A sequence
        that step may finish at max_tokens still takes one row, dropped if it did (as a row after a
        stop token is): rows finish at different steps under speculation, and each would otherwise
        stall the batch's next step until the host has read this one. < 1: the step in flight may
        reach the context's end."""
        remaining = max(seq.tokens_left - ahead, 1)
        room = self.max_model_len - len(seq.token_ids) - ahead
        return min(self.max_width, remaining, room)

    def span(self, seq: Sequence, ahead: int = 0) -> int:
        """Positions the next step writes from its anchor on: the rows it verifies, and with a
        drafter its whole block (`DFlashProposer.draft_hidden`), up to the end of the context."""
        if self.drafter is None:
            return self.width(seq, ahead)
        return min(self.step_rows, self.max_model_len - len(seq.token_ids) - ahead + 1)

    @property
    def step_rows(self) -> int:
        """Most positions a step writes from its anchor on (`span`)."""
        if self.drafter is None:
            return self.max_width
        return max(self.drafter.block_size, self.max_width)  # a shifted block verifies one row more than it has

    def step_widths(self, seqs: list[Sequence], full: list[int]) -> tuple[list[int], int | None]:
        """Each sequence's rows this step (at most `full`), and the width the adaptive policy chose
        (None if it did not choose). A seeded sample depends on where blocks start (its drafts
        do), so it keeps the full, deterministic width to stay reproducible; the step then
        verifies full rows anyway and every sequence takes them. Greedy output never depends on
        widths."""
        if self.adaptive is None or any(s.seeded_sample for s in seqs):
            return full, None
        chosen = self.adaptive.choose(len(seqs), max(full), [s.request_id for s in seqs])
        return [min(chosen, w) for w in full], chosen

    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model directory has no tokenizer: pass prompts as token-id lists")
            return prompt, self.tokenizer.encode(prompt)
        ids = list(prompt)
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary (size {self.vocab_size})")
        return None, ids

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None) -> Sequence:
        text, ids = self.tokenize(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        if any(t >= self.vocab_size for t in params.stop_token_ids):
            raise ValueError(
                f"stop_token_ids {params.stop_token_ids} reach outside the vocabulary (size {self.vocab_size})"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model has none: use stop_token_ids")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens but the context holds {self.max_model_len} "
                "(prompt and at least one generated token)"
            )
        if params.max_tokens is None:  # as vLLM: until the context is full
            params = replace(params, max_tokens=self.max_model_len - len(ids))
        seed = params.seed if params.seed is not None else secrets.randbits(63)  # unseeded: its own
        request_id = request_id if request_id is not None else fresh_request_id(self.requests)
        seq = Sequence(text, ids, params, seed, request_id)
        seq.stop_ids = list(
            dict.fromkeys((self.target.eos_token_ids if not params.ignore_eos else []) + params.stop_token_ids)
        )
        if params.min_tokens and len(seq.stop_ids) > MAX_STOP_IDS:
            raise ValueError(
                f"min_tokens bans at most {MAX_STOP_IDS} eos and stop token ids, and this request has {len(seq.stop_ids)}"
            )
        if seq.request_id in self.requests:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        if params.structured_output is not None:
            seq.grammar = self.grammar_matcher(seq)
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq

    def structured_outputs(self) -> Grammars:
        with self.grammars_made:
            if self.grammars is None:
                self.grammars = Grammars(self.tokenizer, self.vocab_size)
        return self.grammars

    def compile_grammar(self, spec: StructuredOutput) -> None:
        """Compile a grammar ahead of its request, on any thread: a long compile there does not stall
        the engine's steps (`add_request` then finds it compiled)."""
        try:
            self.structured_outputs().compile(spec)
        except ValueError as e:
            raise InvalidSamplingParam("structured_output", str(e)) from e

    @property
    def structured_proposer(self) -> bool:
        """Whether structured requests can run with this proposer (a simulated one ignores masks)."""
        return not isinstance(self.proposer, SimulatedProposer)

    def grammar_matcher(self, seq: Sequence):
        """The matcher of a structured request's grammar."""
        try:
            if not self.structured_proposer:
                raise ValueError("a simulated acceptance rate would ignore the grammar's masks")
            return self.structured_outputs().matcher(seq.params.structured_output, seq.stop_ids)
        except ValueError as e:
            raise InvalidSamplingParam("structured_output", str(e)) from e

    def abort(self, request_id: str) -> None:
        seq = self.requests.get(request_id)
        if seq is not None and not seq.finished:
            self.finish(seq, "abort")

    def finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self.requests.pop(seq.request_id, None)
        if self.adaptive is not None:
            self.adaptive.forget(seq.request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Sequence]:
        """Complete the step in flight, or run one from the committed state; returns the
        sequences that got tokens (finished ones leave the engine). With `run_ahead`, the next
        step is launched before the one in flight is read, from its results still on the device,
        so that the host's bookkeeping overlaps the device's work; a step from the committed
        state then stays in flight until the next call."""
        restore_kernels(self.kernels)
        prev, done = self.in_flight, []
        if prev is not None:
            graphs = self.runner.num_graphs()
            self.in_flight = self.launch_ahead(prev)  # on an error, prev stays in flight
            if self.runner.num_graphs() > graphs:  # a capture (it synchronizes) fell in prev's time
                prev.timed = False
            done = self.complete(prev)
        if self.in_flight is None:
            fresh = self.launch()
            if fresh is not None and self.run_ahead:
                self.in_flight = fresh
            elif fresh is not None:
                done = self.complete(fresh)
        return done

    def launch(self) -> Flight | None:
        """Admit what fits, prefill a chunk of the pending prompts, then launch a step of every
        running sequence whose prompt is done."""
        pages = self.scheduler.kv_cache_manager
        for seq in self.scheduler.admit():
            if seq.params.logit_rules:
                self.runner.reset_penalties(seq, self.num_slots)
            if (checkpoint := pages.restore_slot(seq)) is not None:
                self.runner.copy_state(checkpoint, seq.state_slot)
        chunks = self.scheduler.prefill_chunks()
        if chunks:
            seqs, counts = zip(*chunks)
            self.runner.prefill(list(seqs), list(counts))
            for s in seqs:
                pages.register(s)
                if (checkpoint := pages.checkpoint_slot(s)) is not None:
                    self.runner.copy_state(s.state_slot, checkpoint)
        seqs = [s for s in self.scheduler.schedule_step() if not s.needs_prefill]
        if not seqs:
            return None
        widths, chosen = self.step_widths(seqs, [self.width(s) for s in seqs])
        started = time.perf_counter()
        step = launch_step(self.runner, seqs, widths, None, None)
        return Flight(step, chosen, started, not chunks)  # a prefill's device time is not the step's

    def launch_ahead(self, prev: Flight) -> Flight | None:
        """The next step of prev's sequences, anchored at prev's bonus tokens and its new lengths,
        both still on the device, less the rows of sequences that have finished or that prev ends
        for sure; None where it cannot start before prev is committed (newcomers to admit, a prompt
        still prefilling, a sequence that prev may take to the context's end, pages short)."""
        if not self.run_ahead or self.scheduler.admission_open():
            return None
        # Left out: the finished, and those prev ends for sure (one token left: it commits at least one)
        rows = [i for i, s in enumerate(prev.step.seqs) if not s.finished and s.tokens_left > 1]
        if not rows:
            return None
        seqs, widths = [prev.step.seqs[i] for i in rows], [prev.step.widths[i] for i in rows]
        if any(s.grammar is not None for s in seqs):  # its masks follow the tokens prev commits
            return None
        if any(s.needs_prefill for s in self.scheduler.running):  # its next chunk comes first
            return None
        bound = [self.width(s, ahead=w) for s, w in zip(seqs, widths)]
        # A seeded sample keeps the widths a step from the committed state would give it.
        if any(b < (self.max_width if s.seeded_sample else 1) for s, b in zip(seqs, bound)):
            return None
        ends = [s.num_cached + w + self.span(s, ahead=w) for s, w in zip(seqs, widths)]
        if not self.scheduler.allocate_ahead(seqs, ends):
            return None
        widths_next, chosen = self.step_widths(seqs, bound)
        anchors, starts = prev.step.outcome.bonus, prev.step.outcome.next_starts
        if len(rows) < len(prev.step.seqs):
            kept = self.runner.tensor(rows)
            anchors, starts = anchors[kept], starts[kept]
        launched = launch_step(self.runner, seqs, widths_next, anchors[:, None], starts)
        return Flight(launched, chosen, time.perf_counter(), True, self.step_class(prev))

    def complete(self, flight: Flight) -> list[Sequence]:
        """Read a step's results and commit them (sequences finished meanwhile are skipped)."""
        outputs = finish_step(flight.step)
        now = time.perf_counter()
        seqs = flight.step.seqs
        live = [(s, o) for s, o in zip(seqs, outputs) if not s.finished]
        # Its time measures its width unless a prefill or capture fell in it, or it was left in flight
        # by sequences that finished (the engine may have idled since).
        timed = flight.timed and len(live) == len(seqs)
        if self.adaptive and live:
            # A step launched ahead starts on the device when the step before it ends.
            started = max(flight.launched, self.last_completion)
            ran = timed and flight.chosen is not None  # the time counts for the width class the step ran
            offered = [len(o.draft_token_ids) for _, o in live]
            accepted = [len(o.new_token_ids) - 1 for _, o in live]
            # In its time the host committed the step before it (if launched ahead) and launched the next
            beside = (flight.before, self.in_flight and self.step_class(self.in_flight))
            seconds = now - started if ran else None
            rows = [s.request_id for s, _ in live]
            confidence = [o.confidence for _, o in live]
            chances = [o.chances for _, o in live]
            self.adaptive.observe(
                len(seqs), self.step_class(flight), seconds, offered, accepted, beside, rows, confidence, chances
            )
        self.last_completion = now
        for seq, out in live:
            self.commit(seq, out)
        if self.step_log is not None and live:
            self.step_log.append(StepRecord(now, max(flight.step.widths), len(seqs), timed))
        return [s for s, _ in live]

    def step_class(self, flight: Flight) -> int | None:
        """The width class a step ran (None without adaptive width)."""
        return self.adaptive and self.adaptive.row_class(max(flight.step.widths))

    def commit(self, seq: Sequence, out: StepOutput) -> None:
        for committed, token in enumerate(out.new_token_ids, 1):
            if seq.grammar is not None and not seq.grammar.accept_token(token):
                if not self.grammars.allows_nothing(seq.grammar):
                    raise RuntimeError(f"request {seq.request_id}: token {token} breaks the grammar that masked it")
                # A dead end: the grammar allowed no token (a vocabulary that cannot go on with the
                # match it began), so the row drew from nothing; the request ends without the token.
                committed -= 1
                self.finish(seq, "abort")
                break
            seq.token_ids.append(token)
            reason = self.stop_reason(seq, token)
            if reason is not None:
                self.finish(seq, reason)
                break
        seq.num_cached += committed
        if not seq.finished:  # a finished one gave its pages back
            self.scheduler.kv_cache_manager.register(seq)
        seq.acceptance_lengths.append(committed)  # 0 at a grammar's dead end
        if seq.params.return_drafts:
            seq.draft_token_ids.append(out.draft_token_ids)
        if out.logprobs is not None:
            seq.logprobs += out.logprobs[:committed]

    def stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        stops = seq.num_generated >= p.min_tokens  # before it, nothing stops (stop ids are never drawn)
        if stops and token in seq.stop_ids:
            seq.stopped_on_token = not p.include_stop_str_in_output
            return "stop"
        if p.stop and self.tokenizer is not None:
            added = append_text(self.tokenizer, seq)  # also before min_tokens: stops are sought in new text
            hit = find_stop(seq.text, added, p.stop) if stops else None
            if hit is not None:
                seq.text = seq.text[: hit.stop if p.include_stop_str_in_output else hit.start]
                return "stop"
        if seq.tokens_left <= 0 or len(seq.token_ids) >= self.max_model_len:
            return "length"
        return None

    def output(self, seq: Sequence) -> RequestOutput:
        # Text is decoded when asked for (still incrementally): a batch job pays one decode
        # per request, not one per step (stop strings have decoded per token in stop_reason).
        if self.tokenizer is not None:
            append_text(self.tokenizer, seq, final=seq.finished)
        drafts = seq.draft_token_ids if seq.params.return_drafts else None
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
            outputs=[
                CompletionOutput(
                    0,
                    seq.text,
                    seq.output_token_ids,
                    seq.finish_reason,
                    list(seq.logprobs) if seq.params.logprobs is not None else None,
                )
            ],
            finished=seq.finished,
            metrics=RequestMetrics(list(seq.acceptance_lengths), drafts),
            prompt_logprobs=[None, *seq.prompt_logprobs] if seq.params.prompt_logprobs is not None else None,
        )
