"""The DFlash2 drafter as a proposer: DFlash's block forward (with its block convolutions), then
the candidate selector's walk. Each draft row keeps its K best tokens by the LM head; from the
anchor, each row takes one candidate by its pair score with the candidate the row before took:
the best at T=0, else a draw from the softmax of those K scores at the request's temperature (the
reference's proposal: top-k/top-p apply to the target's side only). That softmax over the K
candidates, zero on every other token, is the q the drafts are verified with; a token outside
them comes only from the residual. A greedy or ancestral walk: no look-ahead."""

from typing import TYPE_CHECKING

import torch

from blockspec.models.dflash2 import DFlash2Drafter
from blockspec.proposers.base import Proposal
from blockspec.proposers.dflash import DFlashProposer
from blockspec.sampling import Stream, draw, tempered_scores, uniform

if TYPE_CHECKING:
    from blockspec.engine.runner import ModelRunner
    from blockspec.engine.step import StepInputs


class DFlash2Proposer(DFlashProposer):
    drafter: DFlash2Drafter

    def propose(self, runner: "ModelRunner", inputs: "StepInputs") -> Proposal:
        d = self.drafter
        if d.candidate_selector is None:
            return super().propose(runner, inputs)
        hidden = self.draft_hidden(runner, inputs)
        logits = d.compute_logits(hidden, runner.target)
        ids, scores = d.candidate_selector.lattice(logits, hidden, inputs.tokens[:, 0])
        return walk(ids, scores, inputs, logits.shape[-1])


def walk(ids: torch.Tensor, scores: torch.Tensor, inputs: "StepInputs", vocab: int) -> Proposal:
    """The drafts along the lattice: ids [B, n, K] each row's candidates, scores [B, n, K, K] of
    (the row before's slot, this row's slot); row 0's predecessor slots are all the anchor."""
    b, n, k = ids.shape
    sampled = inputs.sampling is not None
    if sampled:
        t = inputs.sampling_params[:, 0, None]
        u = uniform(inputs.seeds[:, None], inputs.draft_positions, Stream.DRAFT)
    slot = torch.zeros(b, dtype=torch.long, device=ids.device)
    slots, qs = [], []
    for row in range(n):
        row_scores = scores[:, row].gather(1, slot[:, None, None].expand(-1, 1, k))[:, 0]  # [B, K]
        slot = row_scores.argmax(-1)
        if sampled:
            q = torch.softmax(tempered_scores(row_scores, t), -1)
            slot = torch.where(inputs.greedy, slot, draw(q, u[:, row]))
            qs.append(q)
        slots.append(slot)
    drafts = ids.gather(-1, torch.stack(slots, 1)[..., None])[..., 0]
    if not sampled:
        return Proposal(drafts)
    q = torch.zeros(b, n, vocab, device=ids.device).scatter_(-1, ids, torch.stack(qs, 1))
    return Proposal(drafts, q)
