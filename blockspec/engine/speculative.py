"""One batched decoding step: propose -> verify -> accept -> commit context.

Width w (rows per sequence) = anchor + w-1 drafts; w = 1 is plain decoding through the same
path. Greedy rows are accepted for the whole batch at once; sampled rows run exact
speculative sampling with each sequence's own generator, so a seeded request's output does
not depend on what it is batched with."""

from dataclasses import dataclass

import torch

from blockspec.engine.runner import ModelRunner
from blockspec.engine.sequence import Sequence
from blockspec.sampling import greedy_accept, rejection_sample, sample, token_probs


@dataclass
class StepOutput:
    new_token_ids: list[int]  # accepted drafts followed by the bonus token
    draft_token_ids: list[int]  # what the drafter proposed this step


def draft(runner: ModelRunner, seqs: list[Sequence], widths: list[int]) -> tuple[torch.Tensor, list]:
    """Draft tokens [B, S-1] and, for sampled sequences, the drafter distributions q."""
    logits = runner.propose(seqs, widths)
    drafts = logits.argmax(dim=-1)
    q = [None] * len(seqs)
    for i, s in enumerate(seqs):
        if not s.params.greedy:
            q[i] = token_probs(logits[i, : widths[i] - 1], s.params)
            drafts[i, : widths[i] - 1] = sample(q[i], s.generator)
    return drafts, q


def decode_step(runner: ModelRunner, seqs: list[Sequence], widths: list[int]) -> list[StepOutput]:
    anchors = runner.tensor([s.anchor for s in seqs])[:, None]
    if max(widths) > 1:
        drafts, q = draft(runner, seqs, widths)
    else:
        drafts, q = anchors[:, :0], [None] * len(seqs)
    logits, batch, features = runner.verify(seqs, torch.cat([anchors, drafts], dim=1), widths)
    target_argmax = logits.argmax(dim=-1)
    num_drafts = runner.tensor(widths) - 1
    accepted = greedy_accept(drafts, target_argmax, num_drafts)
    bonus = target_argmax.gather(1, accepted[:, None])[:, 0]
    accepted, bonus = accepted.tolist(), bonus.tolist()
    for i, s in enumerate(seqs):
        if not s.params.greedy:
            n = widths[i] - 1
            p = token_probs(logits[i, : n + 1], s.params)
            q_i = q[i] if q[i] is not None else p[:0]
            accepted[i], bonus[i] = rejection_sample(drafts[i, :n], p, q_i, s.generator)
    runner.write_context(batch, features, runner.tensor(accepted) + 1)
    drafts = drafts.tolist()
    return [StepOutput(drafts[i][: accepted[i]] + [bonus[i]], drafts[i][: widths[i] - 1]) for i in range(len(seqs))]
