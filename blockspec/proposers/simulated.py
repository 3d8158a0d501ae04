"""Benchmarks only: a proposer whose blocks are accepted at a chosen mean acceptance length, so
that random weights can be timed at a realistic tau. It runs the real drafter (the step costs what
a real one does) and imposes its acceptance count instead of the acceptance rule: drafts of a
random drafter are never the target's tokens. Output tokens are then not the target's.

Each draft is accepted with one probability p, given the ones before it were (p solves
1 + p + ... + p^max_drafts = tau): as with real drafters, long runs are rarer than short ones and
narrower blocks commit fewer tokens. The draws are a function of (request seed, block position),
made on the device.

Its drafts are tokens hashed from (request seed, draft position), not the random drafter's: those
repeat one token down a block, where real drafts are as varied as text, and an MoE target routes
a block of one token to a handful of experts, a real block to many (its verify would be timed
far too cheap)."""

import math
from typing import TYPE_CHECKING

import torch

from blockspec.proposers.base import Proposal, Proposer
from blockspec.sampling import Stream, random_bits, uniform

if TYPE_CHECKING:
    from blockspec.engine.runner import ModelRunner
    from blockspec.engine.step import StepInputs


def acceptance_probability(tau: float, max_drafts: int) -> float:
    """p with 1 + p + ... + p^max_drafts = tau (bisection: the mean grows with p)."""
    if not 1 <= tau <= max_drafts + 1:
        raise ValueError(f"a simulated tau must lie in [1, {max_drafts + 1}] (the block width), got {tau}")
    if tau == max_drafts + 1:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(60):
        p = (low + high) / 2
        low, high = (p, high) if sum(p**k for k in range(max_drafts + 1)) < tau else (low, p)
    return low


def geometric_counts(seeds: torch.Tensor, starts: torch.Tensor, num_drafts: torch.Tensor, log_p: float) -> torch.Tensor:
    """floor(log(1 - u) / log p), capped at num_drafts (p < 1), u a hash of (request seed, block
    position): independent of the counts before it, which set the block positions (a sequence
    that advanced with them, a golden-ratio one, would realize another mean)."""
    u = uniform(seeds, starts, Stream.ACCEPT)
    return torch.minimum((torch.log1p(-u) / log_p).long(), num_drafts)


class SimulatedProposer(Proposer):
    def __init__(self, inner: Proposer, tau: float, max_drafts: int) -> None:
        self.inner = inner
        p = acceptance_probability(tau, max_drafts)
        self.log_p = math.log(p) if p > 0 else -math.inf  # -inf: nothing accepted; 0 (p = 1): everything
        self.capture_layers = inner.capture_layers

    def propose(self, runner: "ModelRunner", inputs: "StepInputs") -> Proposal:
        proposal = self.inner.propose(runner, inputs)
        varied = random_bits(inputs.seeds[:, None], inputs.draft_positions, Stream.DRAFT)
        proposal.drafts = (varied % runner.target.config.vocab_size).to(proposal.drafts.dtype)
        proposal.accepted = self.accepted(inputs.seeds, inputs.starts, inputs.lengths - 1)
        proposal.confidence = None  # the drafter's, of drafts replaced: the acceptance is simulated
        return proposal

    def accepted(self, seeds: torch.Tensor, starts: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
        """Drafts accepted of blocks at `starts`, P(accepted >= j) = p^j for j <= num_drafts."""
        if self.log_p == 0:
            return num_drafts
        return geometric_counts(seeds, starts, num_drafts, self.log_p)

    def cache_reaches(self) -> dict[str, int | None]:
        return self.inner.cache_reaches()

    def commit(self, runner, features, starts, counts, block_tables) -> None:
        self.inner.commit(runner, features, starts, counts, block_tables)
