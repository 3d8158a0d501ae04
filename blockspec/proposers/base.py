"""The proposer interface. A proposer makes a step's drafts inside the step (`propose`, on the
device, so a CUDA graph holds it) and, where it keeps a context of its own (a drafter's context
K/V), commits the positions the target accepted (`commit`). A proposer that looks at host state
(n-gram lookup) makes its drafts before the step instead (`host_drafts`); steps then cannot launch
ahead of the results before them."""

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from blockspec.sampling import Stream, argmax, draw, probs, sample_drafts, uniform

if TYPE_CHECKING:
    from blockspec.engine.runner import ModelRunner
    from blockspec.engine.step import StepInputs


@dataclass
class Proposal:
    drafts: torch.Tensor  # [B, w-1]
    # [B, w-1, V] the distributions the sampled rows' drafts were drawn from; None: the drafts are
    # certain (point masses), or every row is greedy, or q is `draft_logits`' softmax, unwritten
    q: torch.Tensor | None = None
    # [B] accepted drafts imposed instead of the acceptance rule (`SimulatedProposer` only)
    accepted: torch.Tensor | None = None
    # [B] drafts to verify, where the proposer cuts them below the step's (a confident prefix)
    num_drafts: torch.Tensor | None = None
    # [B, w-1] each draft's confidence: the predicted chance it is accepted given the drafts before
    # it were (a DSpark confidence head); None: the proposer predicts none
    confidence: torch.Tensor | None = None
    # [B, w-1, V] the drafter's logits, where the sampled rows' drafts were drawn from their softmax
    # at the rows' temperatures, unfiltered (`sampling.sample_block` reads them; on CUDA q is
    # never written out)
    draft_logits: torch.Tensor | None = None


class Proposer:
    """Makes drafts for a step. `on_device`: `propose` needs only the step's device inputs (the
    anchors among them), so a step can launch before the results of the one before reach the host."""

    on_device = True
    confident = False  # its proposals carry each draft's confidence (`Proposal.confidence`)
    capture_layers: tuple[int, ...] = ()  # target layers whose outputs `commit` reads (features)

    def cache_reaches(self) -> dict[str, int | None]:
        """Layer type -> positions before a step's first row its layers read (None: all), for each
        attention layer type of the proposer's own K/V cache (none: no cache)."""
        return {}

    def host_drafts(self, token_ids: list[list[int]], widths: list[int]) -> list[list[int]]:
        """Drafts of each sequence from its tokens, at most widths[i] - 1 (host proposers only)."""
        raise NotImplementedError

    def propose(self, runner: "ModelRunner", inputs: "StepInputs") -> Proposal:
        raise NotImplementedError

    def commit(
        self,
        runner: "ModelRunner",
        features: torch.Tensor | None,
        starts: torch.Tensor,
        counts: torch.Tensor,
        block_tables: torch.Tensor,
    ) -> None:
        """Take in the first counts[b] rows of a forward at starts[b] (committed positions)."""


def draft_from_logits(logits: torch.Tensor, inputs: "StepInputs") -> Proposal:
    """Drafts from a drafter's logits [B, w-1, V]: the argmax for greedy rows; for sampled rows a draw
    from q (their sampling parameters applied to the logits), keyed by the draft's position."""
    drafts = argmax(logits)
    if inputs.sampling is None:
        return Proposal(drafts)
    u = uniform(inputs.seeds[:, None], inputs.draft_positions, Stream.DRAFT)
    if inputs.filters:
        q = probs(logits, inputs.sampling_params[:, None], filters=True)
        return Proposal(torch.where(inputs.greedy[:, None], drafts, draw(q, u)), q)
    sampled, q = sample_drafts(logits, inputs.sampling_params, u)
    return Proposal(torch.where(inputs.greedy[:, None], drafts, sampled), q, draft_logits=logits)


def proposal_q(proposal: Proposal, inputs: "StepInputs") -> torch.Tensor | None:
    """The proposal's q written out (from its `draft_logits` where it holds none): for a step that
    takes its drafts from before it (structured output)."""
    if proposal.q is not None or proposal.draft_logits is None:
        return proposal.q
    return probs(proposal.draft_logits, inputs.sampling_params[:, None], filters=False)
