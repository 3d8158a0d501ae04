"""One batched decoding step: propose -> verify -> accept -> commit context, greedy and sampled
rows alike, as one forward on the device (so one CUDA graph).

Width w (rows per sequence) = anchor + w-1 drafts; w = 1 is plain decoding through the same
path. Greedy rows accept the longest prefix of drafts the target's argmax agrees with; sampled
rows run exact speculative sampling with counter-based uniforms of (request seed, position)
(`blockspec.sampling`), so a seeded request's output does not depend on what it is batched with.
A step is launched (`launch_step`) and later finished (`finish_step`, its one read of device
results); in between, the engine may launch the next step from this one's results still on the
device."""

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

from blockspec.engine.sequence import Sequence
from blockspec.layers.recurrent_state import RecurrentStates
from blockspec.outputs import TokenLogprob
from blockspec.penalties import penalize_rows
from blockspec.proposers.base import Proposal, proposal_q
from blockspec.sampling import (
    MAX_LOGPROBS,
    Stream,
    acceptance_chances,
    argmax,
    ban_early_stops,
    greedy_accept,
    probs,
    residual_tokens,
    sample_block,
    sample_rows,
    sampled_accept,
    token_logprobs,
    uniform,
)
from blockspec.structured_output import mask_logits, token_bitmasks

if TYPE_CHECKING:
    from blockspec.engine.runner import ModelRunner


@dataclass
class StepInputs:
    tokens: torch.Tensor  # [B, w]: column 0 the anchors; then the host's drafts, or the anchors repeated
    starts: torch.Tensor  # [B] position of each anchor
    lengths: torch.Tensor  # [B] rows to verify: the anchor and the drafts (at most w)
    block_tables: torch.Tensor  # [B, G, M] page ids per cache group, padded with the trash page 0
    seeds: torch.Tensor  # [B] request seeds (int64)
    state_slots: torch.Tensor  # [B] each sequence's recurrent state slot (`layers.recurrent_state`)
    # [B, 2] int64 holding float32 [B, 4] bitwise (`sampling_params`); None: every row is greedy
    sampling: torch.Tensor | None = None
    filters: bool = False  # some sampled row uses top-k, top-p or min-p (`SamplingParams.filtered`)
    logprobs: bool = False  # some row reports log-probabilities (`sampling.token_logprobs` runs)
    # Logit rules, all three or none (one graph variant): min_tokens, the position before which a
    # sequence's stop ids [B, MAX_STOP_IDS] (padded with -1) are banned (`sampling.ban_early_stops`),
    # and penalties, [B, 2] int64 holding float32 [B, 4] bitwise (`penalties.penalty_row`; all zero:
    # none). None: no row has penalties or is short of its min_tokens.
    min_positions: torch.Tensor | None = None
    stop_ids: torch.Tensor | None = None
    penalties: torch.Tensor | None = None
    # structured output: [B, w, W] int32, each row's token bitmask (`structured_output.token_bitmasks`);
    # the drafts in `tokens` were proposed before the step, drawn from q [B, w-1, V] where rows are
    # sampled (`ModelRunner.propose`). None: no grammar.
    bitmask: torch.Tensor | None = None
    q: torch.Tensor | None = None
    # A width-1 step whose drafter context is deferred: [B] where in its sequence's ring
    # (`ModelRunner.deferred`) its row's target features go, the positions deferred before it; a
    # flush (`flush_forward`): how many positions before the anchor the ring holds. None: the
    # step commits its own drafter context.
    backlog: torch.Tensor | None = None

    # A CUDA graph's rows past the batch: sequences of one greedy row at position 0, writing to the
    # trash page (0.0 is all zero bits).
    PAD: ClassVar[dict[str, int]] = {
        "tokens": 0,
        "starts": 0,
        "lengths": 1,
        "block_tables": 0,
        "seeds": 0,
        "state_slots": 0,
        "sampling": 0,
        "min_positions": 0,
        "stop_ids": -1,
        "penalties": 0,
        "bitmask": -1,
        "q": 0,
        "backlog": 0,
    }

    @property
    def mode(self) -> str:
        """The step's kind (its CUDA graphs' name): what its rows need computed."""
        kind = "greedy" if self.sampling is None else "filtered" if self.filters else "sampled"
        mode = kind + "+logprobs" * self.logprobs + "+rules" * (self.penalties is not None)
        mode += "+grammar" * (self.bitmask is not None) + "+defer" * (self.backlog is not None)
        return mode + "+q" * (self.q is not None)  # a width-1 step of sampled rows has no q

    @property
    def sampling_params(self) -> torch.Tensor:
        """[B, 4] float32 (`blockspec.sampling.SAMPLING_COLUMNS`)."""
        return self.sampling.view(torch.float32)

    @property
    def penalty_params(self) -> torch.Tensor:
        """[B, 4] float32 (`penalties.penalty_row`)."""
        return self.penalties.view(torch.float32)

    @property
    def greedy(self) -> torch.Tensor:
        """[B] whether each row is greedy (temperature 0)."""
        return self.sampling_params[:, 0] == 0

    @property
    def decided_positions(self) -> torch.Tensor:
        """[B, w] the position of the token each row decides (its own + 1)."""
        return self.starts[:, None] + torch.arange(1, self.tokens.shape[1] + 1, device=self.starts.device)

    @property
    def draft_positions(self) -> torch.Tensor:
        """[B, w-1] the token position each draft stands for."""
        return self.decided_positions[:, :-1]


class StepOutcome:
    """A step's results as named views of one int64 tensor [B, 3 + blocks of w-1] (one copy to the
    host; w the step's width, or under a CUDA graph its width class, a block's columns past a
    sequence's drafts then padding): bonus tokens | accepted counts | the next step's starts | the
    drafts, then where the proposer
    predicts them the drafts' confidences [B, w-1] in fixed point (CONFIDENCE_SCALE; negative: drafts
    proposed before the step, whose confidences the step does not have), then where the runner
    reports them the drafts' chances of acceptance [B, w-1] (`Verdict.chances`), in fixed point
    too. A step launched
    ahead reads its anchors and starts from columns 0 and 2, 16-byte aligned as the host's inputs
    are (Triton compiles a kernel variant per alignment)."""

    BONUS, ACCEPTED, NEXT_STARTS, DRAFTS = 0, 1, 2, 3
    CONFIDENCE_SCALE = 1 << 24

    def __init__(self, packed: torch.Tensor) -> None:
        self.packed = packed

    @classmethod
    def pack(
        cls,
        bonus: torch.Tensor,
        accepted: torch.Tensor,
        next_starts: torch.Tensor,
        drafts: torch.Tensor,
        confidence: torch.Tensor | None = None,
        chances: torch.Tensor | None = None,
    ) -> torch.Tensor:
        columns = [bonus[:, None], accepted[:, None], next_starts[:, None], drafts]
        columns += [torch.round(c.float() * cls.CONFIDENCE_SCALE) for c in (confidence, chances) if c is not None]
        return torch.cat([c.long() for c in columns], 1)

    @property
    def bonus(self) -> torch.Tensor:
        return self.packed[:, self.BONUS]

    @property
    def next_starts(self) -> torch.Tensor:
        return self.packed[:, self.NEXT_STARTS]


def step_forward(runner: "ModelRunner", inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A step on the device alone, so that one CUDA graph holds it whole -> (`StepOutcome.pack`,
    and where rows report them, the log-probabilities of each row's committed token [B, w, ...]
    (`sampling.token_logprobs`; rows past the committed ones hold a rejected draft's))."""
    proposer = runner.proposer
    runner.mark("start")
    proposal = Proposal(inputs.tokens[:, 1:], inputs.q)
    if inputs.tokens.shape[1] > 1 and inputs.bitmask is None:  # with a grammar, proposed before the step
        proposal = proposer.propose(runner, inputs)
    runner.mark("drafter")
    block = torch.cat([inputs.tokens[:, :1], proposal.drafts], dim=1)
    # the linear-attention layers' states advance over the accepted rows only (`commit`, after `accept`)
    states = RecurrentStates.for_block(inputs.state_slots, inputs.starts, inputs.lengths, block.shape[1])
    hidden, features = runner.target_forward(block, inputs.starts, inputs.lengths, inputs.block_tables, states)
    logits = runner.target.compute_logits(hidden)
    runner.mark("verify")
    rule_logits = logits  # logprobs report the raw distribution; the acceptance rule, penalties and bans
    if inputs.penalties is not None:  # one graph for both rules: a min_tokens-only batch pays the penalties' passes too
        counts, prompt = runner.penalty_state.rows(inputs.state_slots)
        rule_logits = penalize_rows(rule_logits, proposal.drafts, counts, prompt, inputs.penalty_params)
        rule_logits = ban_early_stops(rule_logits, inputs.decided_positions, inputs.min_positions, inputs.stop_ids)
    if inputs.bitmask is not None:
        rule_logits = mask_logits(rule_logits, inputs.bitmask)
    result = accept(proposal, rule_logits, inputs, reports_chances(runner, inputs))
    accepted, bonus = result.accepted, result.bonus
    committed = accepted + 1
    runner.mark("accept")
    states.commit(committed)
    if inputs.penalties is not None:
        runner.penalty_state.commit(inputs.state_slots, committed_tokens(proposal.drafts, accepted, bonus), committed)
    runner.mark("rollback")
    if inputs.backlog is not None:  # a width-1 step commits one row: its features wait in the ring
        runner.deferred[inputs.state_slots, inputs.backlog] = features[:, 0]
    elif proposer is not None:
        proposer.commit(runner, features, inputs.starts, committed, inputs.block_tables)
    runner.mark("context")
    confidence = proposal.confidence
    if confidence is None and proposer is not None and proposer.confident:  # drafts made before the step
        confidence = torch.full(proposal.drafts.shape, -1.0, device=proposal.drafts.device)
    packed = StepOutcome.pack(bonus, accepted, inputs.starts + committed, proposal.drafts, confidence, result.chances)
    if not inputs.logprobs:
        return packed, None
    return packed, token_logprobs(logits, committed_tokens(proposal.drafts, accepted, bonus))


def propose_forward(runner: "ModelRunner", inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The proposer alone, for a step whose verify rows need the drafts on the host first (structured
    output) -> ([B, 1 + w-1]: the drafts to verify (the proposer's cut), then the drafts; q or None)."""
    proposal = runner.proposer.propose(runner, inputs)
    num_drafts = inputs.lengths - 1
    if proposal.num_drafts is not None:
        num_drafts = torch.minimum(num_drafts, proposal.num_drafts)
    return torch.cat([num_drafts[:, None].long(), proposal.drafts.long()], 1), proposal_q(proposal, inputs)


def flush_forward(runner: "ModelRunner", inputs: StepInputs) -> tuple[None, None]:
    """Commit the drafter context each sequence's width-1 steps deferred: the target features of
    the `backlog` positions before its anchor, from its ring."""
    backlog = inputs.backlog
    starts = (inputs.starts - backlog).clamp_min(0)  # a warm-up sequence never advances past 0
    runner.proposer.commit(runner, runner.deferred[inputs.state_slots], starts, backlog, inputs.block_tables)
    return None, None


def committed_tokens(drafts: torch.Tensor, accepted: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
    """[B, w] the token each row commits: its draft up to the accepted ones, then the bonus."""
    block = torch.cat([drafts, bonus[:, None]], dim=1)
    rows = torch.arange(block.shape[1], device=block.device)
    return torch.where(rows == accepted[:, None], bonus[:, None], block)


@dataclass
class Verdict:
    accepted: torch.Tensor  # [B] drafts accepted
    bonus: torch.Tensor  # [B] the token after them
    # [B, w-1] each draft's chance of acceptance once the drafts before it were (`sampling.
    # acceptance_chances`; greedy rows 0 or 1: the outcome), for the drafts reached; None: not asked
    chances: torch.Tensor | None = None


def accept(proposal: Proposal, logits: torch.Tensor, inputs: StepInputs, chances: bool = False) -> Verdict:
    """The accepted drafts of every row and the token after them: greedy rows by prefix match with
    the target's argmax, sampled rows by speculative sampling; a simulated proposal's counts replace
    the acceptance rule. Drafts past a proposer's cut (`Proposal.num_drafts`) are never accepted, by
    either. With `chances`, each reached draft's chance of acceptance too: a sampled row's is the
    rule's probability, which tells the adaptive width's rates what its 0/1 outcome does with less
    noise."""
    drafts, num_drafts = proposal.drafts, inputs.lengths - 1
    if proposal.num_drafts is not None:
        num_drafts = torch.minimum(num_drafts, proposal.num_drafts)
    target_argmax = argmax(logits)
    accepted = proposal.accepted
    if accepted is None:
        accepted = greedy_accept(drafts, target_argmax, num_drafts)
    else:
        accepted = torch.minimum(accepted, num_drafts)
    greedy_bonus = target_argmax.gather(1, accepted[:, None])[:, 0]
    if inputs.sampling is None:
        return verdict(accepted, greedy_bonus, drafts, num_drafts, chances)
    greedy, seeds = inputs.greedy, inputs.seeds
    if not drafts.shape[1] and not inputs.filters:  # a plain step: each row's token from its one row of logits
        u = uniform(seeds, inputs.starts + 1, Stream.RESIDUAL)
        sampled = sample_rows(logits[:, 0], inputs.sampling_params, u)
        return verdict(accepted, torch.where(greedy, greedy_bonus, sampled), drafts, num_drafts, chances)
    ruled = chances and proposal.accepted is None  # a simulated proposal's chances are its imposed outcomes
    if proposal.draft_logits is not None:  # q: the drafter's softmax, unfiltered
        u = uniform(seeds[:, None], inputs.draft_positions, Stream.ACCEPT)
        u_residual = uniform(seeds[:, None], inputs.decided_positions, Stream.RESIDUAL)
        imposed = None if proposal.accepted is None else accepted
        block = sample_block(
            logits, proposal.draft_logits, proposal.q, drafts, num_drafts, inputs.sampling_params, u, u_residual,
            imposed, ruled,
        )  # fmt: skip
        accepted = torch.where(greedy, accepted, block.accepted)
        bonus = torch.where(greedy, greedy_bonus, block.token)
        return verdict(accepted, bonus, drafts, num_drafts, chances, greedy, block.chances)
    p = probs(logits, inputs.sampling_params[:, None], inputs.filters)
    q = proposal.q  # None: point masses at the drafts (n-gram lookup), read at the drafts alone
    if proposal.accepted is None:
        u = uniform(seeds[:, None], inputs.draft_positions, Stream.ACCEPT)
        accepted = torch.where(greedy, accepted, sampled_accept(drafts, p, q, num_drafts, u))
    u = uniform(seeds, inputs.starts + accepted + 1, Stream.RESIDUAL)
    bonus = torch.where(greedy, greedy_bonus, residual_tokens(accepted, p, q, num_drafts, u, drafts))
    rule = acceptance_chances(p, q, torch.minimum(accepted + 1, num_drafts), drafts) if ruled else None
    return verdict(accepted, bonus, drafts, num_drafts, chances, greedy, rule)


def verdict(
    accepted: torch.Tensor,
    bonus: torch.Tensor,
    drafts: torch.Tensor,
    num_drafts: torch.Tensor,
    chances: bool,
    greedy: torch.Tensor | None = None,
    rule: torch.Tensor | None = None,
) -> Verdict:
    """A `Verdict`; with `chances` each draft's: the acceptance rule's where it gave them (`rule`
    [B, w-1], of the rows not `greedy`), else its outcome (1 accepted, 0 rejected or unreached)."""
    if not chances:
        return Verdict(accepted, bonus)
    cols = torch.arange(drafts.shape[1], device=drafts.device)
    outcomes = (cols < torch.minimum(accepted, num_drafts)[:, None]).float()
    return Verdict(accepted, bonus, outcomes if rule is None else torch.where(greedy[:, None], outcomes, rule))


@dataclass
class StepOutput:
    new_token_ids: list[int]  # accepted drafts followed by the bonus token
    draft_token_ids: list[int]  # what the proposer proposed this step
    logprobs: list[TokenLogprob] | None = None  # of the new tokens, where the request asks for them
    confidence: np.ndarray | None = None  # of each draft, where the proposer predicts them
    chances: np.ndarray | None = None  # of each draft reached, its chance of acceptance, where reported


@dataclass
class LaunchedStep:
    """A step whose work is queued on the device: its results reach the host in `host` once
    `ready` (None: already there) has passed."""

    seqs: list[Sequence]
    widths: list[int]
    # On the device; with CUDA graphs a graph's output: read it (the next step launched from it
    # does) before that graph replays again.
    outcome: StepOutcome
    host: torch.Tensor  # its packed copy on the host
    logprobs: torch.Tensor | None  # its log-probabilities' copy on the host (None: no row asked)
    ready: torch.cuda.Event | None
    confident: bool = False  # the packed rows hold the drafts' confidences after the drafts
    chanced: bool = False  # the packed rows end in the drafts' chances of acceptance


def launch_step(
    runner: "ModelRunner",
    seqs: list[Sequence],
    widths: list[int],
    anchors: torch.Tensor | None,
    starts: torch.Tensor | None,
) -> LaunchedStep:
    """Queue a step for blocks anchored at `anchors` [B, 1] on the device (None: the sequences'
    anchors, from the host) at positions `starts` [B] (None: the committed lengths); a step launched
    ahead passes both while the step before is still computing them. A host proposer's drafts
    are looked up first, and where a sequence follows a grammar a device proposer's drafts are
    proposed first (the host masks the verify rows by them); they set the widths."""
    proposer, host_drafts, q = runner.proposer, None, None
    grammar = any(s.grammar is not None for s in seqs)
    flush_context(runner, seqs, max(widths), anchors, starts)
    if proposer is not None and max(widths) > 1:
        if not proposer.on_device:
            host_drafts = proposer.host_drafts([s.token_ids for s in seqs], widths)
        elif grammar:
            host_drafts, q = runner.propose(runner.step_inputs(seqs, widths, None, None), widths)
        widths = [len(d) + 1 for d in host_drafts] if host_drafts is not None else widths
    bitmask = None
    if grammar:  # from the committed state: the matchers have taken every token before the anchors
        blocks = [[s.anchor, *d] for s, d in zip(seqs, host_drafts or [[]] * len(seqs))]
        bitmask = token_bitmasks([s.grammar for s in seqs], blocks, max(widths), runner.vocab_size)
        q = q[:, : max(widths) - 1] if q is not None and max(widths) > 1 else None  # all cut to none: no q
    backlog = defer_context(runner, seqs, max(widths))
    inputs = runner.step_inputs(seqs, widths, anchors, starts, host_drafts, bitmask, q, backlog)
    packed, logprobs = runner.step(inputs)
    (host, host_logprobs), ready = runner.to_host(packed, logprobs)
    confident = proposer is not None and proposer.confident
    chanced = reports_chances(runner, inputs)
    return LaunchedStep(seqs, widths, StepOutcome(packed), host, host_logprobs, ready, confident, chanced)


def reports_chances(runner: "ModelRunner", inputs: StepInputs) -> bool:
    """Whether the step packs its drafts' chances of acceptance: where the runner reports them and
    some row samples (a greedy row's chances are its outcomes, which the host has already)."""
    return runner.reports_chances and inputs.sampling is not None


def flush_context(
    runner: "ModelRunner", seqs: list[Sequence], width: int, anchors: torch.Tensor | None, starts: torch.Tensor | None
) -> None:
    """Before a step that drafts (width > 1), or one that would overfill a sequence's ring, commit
    the drafter context the sequences' width-1 steps deferred."""
    if runner.deferred is None or not any(s.num_deferred for s in seqs):
        return
    if width == 1 and max(s.num_deferred for s in seqs) < runner.deferred.shape[1]:
        return
    backlog = [s.num_deferred for s in seqs]
    runner.flush(runner.step_inputs(seqs, [1] * len(seqs), anchors, starts, backlog=backlog))
    for s in seqs:
        s.num_deferred = 0


def defer_context(runner: "ModelRunner", seqs: list[Sequence], width: int) -> list[int] | None:
    """Where a width-1 step defers its drafter context: each sequence's place in its ring (None:
    the step commits it). A width-1 step commits exactly one token a sequence, so the host counts
    the deferred positions as it launches steps, also ahead of their results."""
    if runner.deferred is None or width > 1:
        return None
    backlog = [s.num_deferred for s in seqs]
    for s in seqs:
        s.num_deferred += 1
    return backlog


def finish_step(step: LaunchedStep) -> list[StepOutput]:
    """Wait for the step's results and return them per sequence."""
    if step.ready is not None:
        step.ready.synchronize()
    rows = step.host.tolist()
    a, b, d = StepOutcome.ACCEPTED, StepOutcome.BONUS, StepOutcome.DRAFTS
    outputs = [StepOutput(r[d : d + r[a]] + [r[b]], r[d : d + w - 1]) for r, w in zip(rows, step.widths)]
    n = (step.host.shape[1] - d) // (1 + step.confident + step.chanced)  # drafts' columns
    if step.confident and n:  # after the drafts, as many columns of their confidences
        confidence = step.host[:, d + n : d + 2 * n].numpy() / StepOutcome.CONFIDENCE_SCALE
        for out, c, w in zip(outputs, confidence, step.widths):
            out.confidence = c[: w - 1] if c[-1] >= 0 else None  # negative: drafts made before the step
    if step.chanced and n:  # the last columns
        chances = step.host[:, -n:].numpy() / StepOutcome.CONFIDENCE_SCALE
        for out, c, w in zip(outputs, chances, step.widths):
            out.chances = c[: w - 1]
    if step.logprobs is not None:
        for seq, out, rows_lp in zip(step.seqs, outputs, step.logprobs.tolist()):
            if seq.params.logprobs is not None:
                out.logprobs = [row_logprob(t, lp, seq.params.logprobs) for t, lp in zip(out.new_token_ids, rows_lp)]
    return outputs


def row_logprob(token: int, row: list[float], k: int) -> TokenLogprob:
    """A row of `token_logprobs`, its k most likely tokens kept."""
    values, ids = row[1 : 1 + MAX_LOGPROBS], row[1 + MAX_LOGPROBS :]
    return TokenLogprob(token, row[0], {int(i): v for i, v in zip(ids[:k], values[:k])})
