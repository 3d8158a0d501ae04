"""Repetition, presence and frequency penalties, as vLLM applies them, exact under speculation.

A request's penalties change the target's logits before temperature and filters: tokens of its
prompt or output are divided by `repetition_penalty` where positive, multiplied where not; then
each output token's logit loses `frequency_penalty` per occurrence and `presence_penalty` once.
Each sequence's output-token counts and prompt tokens live on the device, in the row of its state
slot (`PenaltyState`), updated inside the step by the tokens it commits. A verify row decides the
token after the drafts before it, so those drafts count as output for that row: the row's logits
are penalized with the counts plus the drafts before it. The acceptance rule then verifies against
exactly the distribution plain decoding would sample: the drafts stay lossless. Log-probabilities
report the raw logits (vLLM's default)."""

from dataclasses import dataclass

import torch

from blockspec.sampling import SamplingParams


def penalty_row(params: SamplingParams) -> list[float]:
    """A request's penalties as one row of a step's float32 [B, 4] penalty tensor: presence,
    frequency, repetition - 1, and 0 (all zeros: none, as padding rows are)."""
    return [params.presence_penalty, params.frequency_penalty, params.repetition_penalty - 1.0, 0.0]


def penalize(logits: torch.Tensor, counts: torch.Tensor, prompt: torch.Tensor, penalties: torch.Tensor) -> torch.Tensor:
    """logits [..., V] penalized given each token's output count [..., V], whether the prompt holds
    it (prompt [..., V]) and the penalties [..., 4] (`penalty_row`)."""
    presence, frequency, repetition = (penalties[..., i, None] for i in range(3))
    repetition = repetition + 1
    repeated = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(prompt | (counts > 0), repeated, logits)
    return logits - frequency * counts - presence * (counts > 0)


def penalize_rows(
    logits: torch.Tensor, drafts: torch.Tensor, counts: torch.Tensor, prompt: torch.Tensor, penalties: torch.Tensor
) -> torch.Tensor:
    """A step's logits [B, w, V] penalized row by row: row r with the output counts [B, V] plus the
    drafts [B, w-1] before it (prompt [B, V]: the prompt's tokens; penalties [B, 4])."""
    rows = penalize(logits, counts[:, None].float(), prompt[:, None], penalties[:, None])
    w = logits.shape[1]
    if w == 1:
        return rows
    # Row r differs from that only at the drafts' tokens: there, the count of draft j's token is
    # its output count plus the drafts before r that are that token (every j is written, each the
    # same value where drafts repeat a token).
    r, i = torch.arange(w, device=logits.device)[:, None], torch.arange(w - 1, device=logits.device)[None]
    before = (i < r).float()  # [w, w-1]: draft i comes before row r
    same = (drafts[:, :, None] == drafts[:, None, :]).float()  # [B, w-1, w-1]: drafts j and i
    count = counts.gather(1, drafts)[:, None].float() + torch.einsum("bji,ri->brj", same, before)
    tokens = drafts[:, None, :].expand(-1, w, -1)  # [B, w, w-1]: row r, draft j
    in_prompt = prompt.gather(1, drafts)[:, None].expand(-1, w, -1)
    return rows.scatter(2, tokens, penalize(logits.gather(2, tokens), count, in_prompt, penalties[:, None]))


@dataclass
class PenaltyState:
    """Per state slot: output-token counts [slots, V] (int32) and the prompt's tokens [slots, V]."""

    counts: torch.Tensor
    prompt: torch.Tensor

    @classmethod
    def allocate(cls, num_slots: int, vocab_size: int, device: torch.device) -> "PenaltyState":
        zeros = torch.zeros(num_slots, vocab_size, dtype=torch.int32, device=device)
        return cls(zeros, torch.zeros(num_slots, vocab_size, dtype=torch.bool, device=device))

    def reset(self, slot: int, prompt: list[int], output: list[int]) -> None:
        """A sequence's row, from its tokens (at admission: a preempted one brings its output)."""
        device = self.counts.device
        self.counts[slot] = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=self.counts.shape[1]).to(
            device
        )
        self.prompt[slot] = False
        self.prompt[slot, torch.tensor(prompt, dtype=torch.long, device=device)] = True

    def commit(self, slots: torch.Tensor, tokens: torch.Tensor, committed: torch.Tensor) -> None:
        """Count each sequence's committed tokens (its first committed[b] of tokens [B, w])."""
        rows = torch.arange(tokens.shape[1], device=tokens.device)
        index = (slots[:, None] * self.counts.shape[1] + tokens).flatten()
        self.counts.view(-1).index_add_(0, index, (rows < committed[:, None]).int().flatten())

    def rows(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.counts[slots], self.prompt[slots]
