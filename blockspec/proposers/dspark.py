"""The DSpark drafter as a proposer: DFlash's block forward on shifted rows, then its drafts drawn
row by row, each row's logits corrected by the Markov head from the token drafted before it; the
distribution a sampled draft is drawn from (q, for the acceptance test) is that corrected one.
With a confidence head and a threshold, only the leading drafts whose confidence is at least the
threshold are verified, possibly none (DeepSpec's cut: keeping row j's draft reads the confidences of rows 0..j only,
each of which reads the token before its row, so the cut never depends on a draft it keeps). The
confidences also reach the adaptive width policy (`engine.adaptive`), which sets later steps' widths
by them."""

from typing import TYPE_CHECKING

import torch

from blockspec.layers.fast_path import fast_kernels
from blockspec.models.dspark import DSparkDrafter
from blockspec.proposers.base import Proposal, draft_from_logits
from blockspec.proposers.dflash import DFlashProposer
from blockspec.sampling import Stream, argmax, draw, probs, uniform

if TYPE_CHECKING:
    from blockspec.config import SpeculativeConfig
    from blockspec.engine.runner import ModelRunner
    from blockspec.engine.step import StepInputs


class DSparkProposer(DFlashProposer):
    def __init__(self, drafter: DSparkDrafter, window: int | None = None, confidence_threshold: float = 0.0) -> None:
        super().__init__(drafter, window)
        self.confidence_threshold = confidence_threshold
        self.confident = drafter.confidence_head is not None

    @classmethod
    def from_config(cls, drafter: DSparkDrafter, spec: "SpeculativeConfig") -> "DSparkProposer":
        if spec.confidence_threshold > 0 and drafter.confidence_head is None:
            raise ValueError(
                "confidence_threshold needs a drafter with a confidence head; this DSpark drafter has none"
            )
        return cls(drafter, spec.window, spec.confidence_threshold)

    def propose(self, runner: "ModelRunner", inputs: "StepInputs") -> Proposal:
        d = self.drafter
        hidden = self.draft_hidden(runner, inputs)
        base = d.draft_logits(hidden, runner.target)
        if d.markov_head is None:
            proposal, prev_embeddings = draft_from_logits(d.to_target(base, runner.target), inputs), None
        else:
            proposal, prev_embeddings = self.markov_chain(runner, inputs, hidden, base)
        logits = d.confidence_logits(hidden, prev_embeddings)
        if logits is None:
            return proposal
        proposal.confidence = torch.sigmoid(logits)
        if self.confidence_threshold > 0:
            confident = proposal.confidence >= self.confidence_threshold
            proposal.num_drafts = confident.int().cumprod(1).sum(1)
        return proposal

    def markov_chain(
        self, runner: "ModelRunner", inputs: "StepInputs", hidden: torch.Tensor, base: torch.Tensor
    ) -> tuple[Proposal, torch.Tensor]:
        """Drafts row by row: row j's logits are base[:, j] plus the Markov bias of the token before
        it (the anchor, then row j-1's draft). Returns the proposal and markov_w1 of each row's
        previous token [B, n, r]. With a vanilla head on CUDA, greedy or sampled without top-k,
        top-p or min-p, one kernel a row (`blockspec.layers.kernels.markov_chain`)."""
        d, target, head = self.drafter, runner.target, self.drafter.markov_head
        sampled = inputs.sampling is not None
        if sampled:
            u = uniform(inputs.seeds[:, None], inputs.draft_positions, Stream.DRAFT)
            params = inputs.sampling_params
        fusable = head.kind == "vanilla" and not (sampled and inputs.filters)
        kernels = fast_kernels(base, "markov_chain") if fusable else None
        if kernels is not None:
            w1, w2 = head.markov_w1.weight, head.markov_w2.weight
            temperature, uniforms = (params[:, 0], u) if sampled else (None, None)
            chain = kernels.markov_chain(
                base, inputs.tokens[:, 0], w1, w2, d.draft_to_target, hidden.dtype, temperature, uniforms
            )
            q = None if chain.q is None else d.to_target(chain.q, target, fill=0.0)
            return Proposal(chain.drafts, q), chain.embeddings
        prev, state = inputs.tokens[:, 0], head.initial_state(hidden[:, 0])
        drafts, qs, embeddings = [], [], []
        for j in range(base.shape[1]):
            latent, e, state = head.step(prev, hidden[:, j], state)
            logits = d.to_target(base[:, j].float() + head.bias(latent).float(), target)
            prev = argmax(logits)
            if sampled:
                q = probs(logits, params, inputs.filters)
                prev = torch.where(inputs.greedy, prev, draw(q, u[:, j]))
                qs.append(q)
            drafts.append(prev)
            embeddings.append(e)
        q = torch.stack(qs, 1) if sampled else None
        return Proposal(torch.stack(drafts, 1), q), torch.stack(embeddings, 1)
