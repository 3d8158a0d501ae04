"""One batched decoding step: propose -> verify -> accept -> commit context.

Width w (rows per sequence) = anchor + w-1 drafts; w = 1 is plain decoding through the same
path. Greedy rows are accepted for the whole batch at once; sampled rows run exact
speculative sampling with each sequence's own generator, so a seeded request's output does
not depend on what it is batched with. A step is launched (`launch_step`) and later finished
(`finish_step`, its one read of device results); in between, the engine may launch the next
step from this one's results still on the device."""

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from blockspec.engine.runner import ModelRunner
from blockspec.engine.sequence import Sequence
from blockspec.sampling import argmax, greedy_accept, rejection_sample, sample, token_probs


@dataclass
class StepOutput:
    new_token_ids: list[int]  # accepted drafts followed by the bonus token
    draft_token_ids: list[int]  # what the drafter proposed this step


class SimulatedAcceptance:
    """Benchmarks only: replaces greedy acceptance by draws with mean acceptance length `tau` at
    the full block (`max_drafts` drafts), so that random weights can be timed at a realistic tau.
    Each draft is accepted with one probability p, given the ones before it were (p solves
    1 + p + ... + p^max_drafts = tau): as with real drafters, long runs are rarer than short ones
    and narrower blocks commit fewer tokens. Output tokens are then not the target's.

    The draws invert that distribution at a golden-ratio sequence of uniforms (low-discrepancy)
    rather than at random ones, one sequence per request, each started at its own offset, so that a
    short bench (20 steps at batch 1) realizes tau within about +-0.7 (5.7-7.2 at tau 6.5, block
    16, over 1,000 windows' starts) rather than +-2 standard errors of about 1."""

    GOLDEN = 0.6180339887498949
    SQRT2 = 1.4142135623730951  # spreads the streams' offsets (a Weyl sequence over requests)

    def __init__(self, tau: float, max_drafts: int) -> None:
        if not 1 <= tau <= max_drafts + 1:
            raise ValueError(f"a simulated tau must lie in [1, {max_drafts + 1}] (the block width), got {tau}")
        low, high = 0.0, 1.0
        for _ in range(60):  # bisection: the mean grows with p
            p = (low + high) / 2
            low, high = (p, high) if sum(p**k for k in range(max_drafts + 1)) < tau else (low, p)
        self.p = low
        self.u: dict[str, float] = {}  # request id -> its stream's last uniform

    def __call__(self, num_drafts: int, request_id: str) -> int:
        """P(accepted >= j) = p^j for j <= num_drafts: accepted = floor(log u / log p), capped
        (p < 1 always; p = 0 at tau 1)."""
        if request_id not in self.u:
            self.u[request_id] = (0.5 + len(self.u) * self.SQRT2) % 1.0
        u = self.u[request_id] = (self.u[request_id] + self.GOLDEN) % 1.0
        if self.p == 0.0:
            return 0
        return min(num_drafts, int(math.log(1.0 - u) / math.log(self.p)))


def dflash_draft(
    runner: ModelRunner, seqs: list[Sequence], widths: list[int], anchors: torch.Tensor, inputs: tuple
) -> tuple[torch.Tensor, list, list]:
    """Draft tokens [B, S-1], for sampled sequences the drafter distributions q, and the widths."""
    logits = runner.propose(anchors, inputs, max(widths))
    drafts = argmax(logits)
    q = [None] * len(seqs)
    for i, s in enumerate(seqs):
        if not s.params.greedy:
            q[i] = token_probs(logits[i, : widths[i] - 1], s.params)
            drafts[i, : widths[i] - 1] = sample(q[i], s.generator)
    return drafts, q, widths


# (runner, seqs, widths, anchors [B, 1], step inputs) -> (drafts [B, S-1], q per sequence, widths used)
Proposer = Callable[[ModelRunner, list[Sequence], list[int], torch.Tensor, tuple], tuple[torch.Tensor, list, list[int]]]


def sample_step(
    seq: Sequence, drafts: torch.Tensor, logits: torch.Tensor, q: torch.Tensor | None, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact speculative sampling of one sequence's block: (accepted, token) on the device."""
    p = token_probs(logits[:width], seq.params)
    return rejection_sample(drafts[: width - 1], p, q if q is not None else p[:0], seq.generator)


@dataclass
class LaunchedStep:
    """A step whose work is queued on the device: its results reach the host in `host` once
    `ready` (None: already there) has passed."""

    seqs: list[Sequence]
    widths: list[int]
    # [B, 3 + S-1] on the device (`pack_outcome`); a fused step's graph output: read it (the next
    # step launched from it does) before that graph replays again.
    packed: torch.Tensor
    host: torch.Tensor  # its copy on the host
    ready: torch.cuda.Event | None

    @property
    def bonus(self) -> torch.Tensor:
        """[B]: the next step's anchors."""
        return self.packed[:, 0]

    @property
    def next_starts(self) -> torch.Tensor:
        """[B]: the next step's starts (the positions after the accepted drafts)."""
        return self.packed[:, 2]


def simulated_counts(simulated: SimulatedAcceptance | None, seqs: list[Sequence], widths: list[int]) -> list:
    """[the simulated accepted count of each sequence's drafts] (drawn once a step), or [] when not
    simulating."""
    if simulated is None:
        return []
    return [[simulated(w - 1, s.request_id) for s, w in zip(seqs, widths, strict=True)]]


@torch.inference_mode()  # the ops' CUDA fast paths (argmax among them) run without grad
def launch_step(
    runner: ModelRunner,
    seqs: list[Sequence],
    widths: list[int],
    anchors: torch.Tensor,
    starts: torch.Tensor | None,
    proposer: Proposer = dflash_draft,
    simulated: SimulatedAcceptance | None = None,
    fused: bool = True,
) -> LaunchedStep:
    """Queue propose -> verify -> accept -> commit context for blocks anchored at `anchors` [B, 1]
    at positions `starts` [B] (None: the committed lengths); a step launched ahead passes both
    while the step before is still computing them. `fused`: an all-greedy step with the drafter
    (or plain decoding) runs as one forward (`greedy_step_forward`), so one CUDA graph instead of
    three and the ops between them (H200, bench --simulate-tau 6.5, a kernel trace of the DFlash
    step at batch 1: 212 -> 155 us a step between kernels)."""
    if fused and proposer is dflash_draft and all(s.params.greedy for s in seqs):
        inputs, forced = runner.step_inputs(seqs, widths, starts, *simulated_counts(simulated, seqs, widths))
        name = "greedy_step" if simulated is None else "simulated_step"
        step = functools.partial(greedy_step_forward, runner)
        packed = runner.run(name, step, anchors.expand(-1, max(widths)), *inputs, *forced)
        return LaunchedStep(seqs, widths, packed, *runner.to_host(packed))
    inputs, _ = runner.step_inputs(seqs, widths, starts)
    drafts, q = anchors[:, :0], [None] * len(seqs)
    if max(widths) > 1:
        drafts, q, used = proposer(runner, seqs, widths, anchors, inputs)
        if used != widths:  # the n-gram proposer fills only what it found: new lengths
            widths, inputs = used, (inputs[0], runner.tensor(used), inputs[2])
    forced = [runner.tensor(c) for c in simulated_counts(simulated, seqs, widths)]  # drawn at the widths run
    logits, features = runner.verify(torch.cat([anchors, drafts], dim=1), inputs)
    accepted, bonus = greedy_outcome(drafts, argmax(logits), inputs[1] - 1, *forced)
    sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if sampled:  # each with its own generator, still without waiting for the device
        results = [sample_step(seqs[i], drafts[i], logits[i], q[i], widths[i]) for i in sampled]
        rows = runner.tensor(sampled)
        accepted = accepted.index_put((rows,), torch.stack([a for a, _ in results]).to(accepted.dtype))
        bonus = bonus.index_put((rows,), torch.stack([t for _, t in results]).to(bonus.dtype))
    # The step's one read of device results, copied before the context commit is queued, so that
    # the read does not wait for it.
    committed = accepted + 1
    packed = pack_outcome(accepted, bonus, inputs[0] + committed, drafts)
    launched = LaunchedStep(seqs, widths, packed, *runner.to_host(packed))
    runner.commit_context(features, inputs, committed)
    return launched


def greedy_outcome(
    drafts: torch.Tensor, target_argmax: torch.Tensor, num_drafts: torch.Tensor, forced: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted drafts [B], bonus tokens [B]) of greedy verification, or with `forced` [B] (the
    simulated acceptance) those counts accepted instead."""
    accepted = greedy_accept(drafts, target_argmax, num_drafts) if forced is None else forced
    return accepted, target_argmax.gather(1, accepted[:, None])[:, 0]


def pack_outcome(
    accepted: torch.Tensor, bonus: torch.Tensor, next_starts: torch.Tensor, drafts: torch.Tensor
) -> torch.Tensor:
    """[B, 3 + S-1]: bonus tokens, accepted counts, the next step's starts and the drafts, for one
    copy to the host; a step launched ahead starts from its columns 0 and 2 (in a fused step they
    come out of the step's CUDA graph: two eager adds between the graphs before), which are 16-byte
    aligned as the host's inputs are (Triton compiles a kernel variant per alignment)."""
    return torch.cat([bonus[:, None].long(), accepted[:, None].long(), next_starts[:, None].long(), drafts.long()], 1)


def greedy_step_forward(
    runner: ModelRunner,
    anchors: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    block_tables: torch.Tensor,
    *forced: torch.Tensor,
) -> torch.Tensor:
    """A greedy step on the device alone, so that one CUDA graph holds it whole: the drafts (where
    anchors [B, w], each block's anchor repeated, has w > 1), the verify, the acceptance (`forced`:
    the simulated counts) and the drafter's context commit -> `pack_outcome`."""
    drafts = anchors[:, 1:]
    if anchors.shape[1] > 1:
        drafts = argmax(runner.propose_forward(anchors, starts, runner.block_lengths(starts), block_tables))
    logits, features = runner.verify_forward(torch.cat([anchors[:, :1], drafts], dim=1), starts, lengths, block_tables)
    accepted, bonus = greedy_outcome(drafts, argmax(logits), lengths - 1, *forced)
    committed = accepted + 1
    if runner.drafter is not None:
        runner.context_forward(features, starts, committed, block_tables)
    return pack_outcome(accepted, bonus, starts + committed, drafts)


def finish_step(step: LaunchedStep) -> list[StepOutput]:
    """Wait for the step's results and return them per sequence."""
    if step.ready is not None:
        step.ready.synchronize()
    rows = step.host.tolist()
    return [StepOutput(r[3 : 3 + r[1]] + [r[0]], r[3 : 2 + w]) for r, w in zip(rows, step.widths)]
