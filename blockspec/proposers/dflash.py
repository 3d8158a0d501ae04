"""The DFlash drafter as a proposer: one forward over the block [anchor, MASK, ...] that attends to
the drafter's context K/V of the committed positions, then its LM head; every draft drawn at once."""

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from blockspec.engine.batch import Batch, make_batch, window_range
from blockspec.engine.kv_cache_manager import layer_reaches
from blockspec.layers.attention import AttentionMetadata, KeyRange
from blockspec.models.dflash import DFlashDrafter
from blockspec.proposers.base import Proposal, Proposer, draft_from_logits

if TYPE_CHECKING:
    from blockspec.config import SpeculativeConfig
    from blockspec.engine.runner import ModelRunner
    from blockspec.engine.step import StepInputs


def block_ranges(d: DFlashDrafter, b: Batch, ctx_start: torch.Tensor) -> dict[str, KeyRange]:
    """Each layer type's keys for the block rows, as z-lab's reference (07ebd93) masks them: the
    context from `ctx_start` and the whole block (bidirectional), or (causal) the rows up to each
    row's own; a sliding layer's row at position p sees keys k with p - window < k, and k <= p
    (causal) or k < p + window (`DFlashDrafter.is_causal` says which layers are causal)."""
    start, end = ctx_start[:, None].expand_as(b.positions), b.ends[:, None].expand_as(b.positions)
    ranges = {"full_attention": (start, b.positions + 1) if d.is_causal else (start, end)}
    if d.sliding_window is not None:
        low, high = window_range(b.positions, d.sliding_window)
        if d.is_causal is False:  # symmetric: keys before p + window too
            high = torch.minimum(b.positions + d.sliding_window, end)
        ranges["sliding_attention"] = (torch.maximum(low, start), high)
    return ranges


class DFlashProposer(Proposer):
    def __init__(self, drafter: DFlashDrafter, window: int | None = None) -> None:
        self.drafter = drafter
        self.window = window  # the drafter sees only the last `window` context positions
        self.capture_layers = drafter.target_layer_ids

    @classmethod
    def from_config(cls, drafter: DFlashDrafter, spec: "SpeculativeConfig") -> "DFlashProposer":
        if spec.confidence_threshold > 0:
            raise ValueError(
                "confidence_threshold needs a drafter with a confidence head (DSpark's); this one has none"
            )
        return cls(drafter, spec.window)

    def propose(self, runner: "ModelRunner", inputs: "StepInputs") -> Proposal:
        return draft_from_logits(self.drafter.compute_logits(self.draft_hidden(runner, inputs), runner.target), inputs)

    def draft_hidden(self, runner: "ModelRunner", inputs: "StepInputs") -> torch.Tensor:
        """The drafter's normed hidden states [B, w-1, H] of the block rows that make the step's
        w-1 drafts (w: its width). The drafter runs its whole block, [anchor, MASK, ...] up to the
        context's end, the layout it was trained on: cut to w rows, the same drafts come out less
        accurate."""
        d = self.drafter
        width = inputs.tokens.shape[1]
        block = F.pad(inputs.tokens[:, :1], (0, d.block_size - 1), value=d.mask_token_id)
        lengths = (runner.max_model_len - inputs.starts).clamp_max(d.block_size)
        b = make_batch(inputs.starts, lengths, inputs.block_tables, d.block_size, runner.page_size)
        ctx_start = (b.starts - self.window).clamp_min(0) if self.window is not None else torch.zeros_like(b.starts)
        ranges = block_ranges(d, b, ctx_start)
        attn = AttentionMetadata(
            b.block_tables, b.slot_mapping, runner.layout.drafter, ranges, runner.page_size, b.starts
        )
        hidden = d(d.embed(block, runner.target), b.positions, attn, runner.drafter_cache)
        return hidden[:, d.first_draft_row : d.first_draft_row + width - 1]

    def cache_reaches(self) -> dict[str, int | None]:
        """The drafter's attention layer types and the context before the block each reads: a
        sliding layer's window, and the whole context (None) or the last `window` positions."""
        d = self.drafter
        return layer_reaches(d.layers, d.sliding_window, self.window)

    def commit(self, runner, features, starts, counts, block_tables) -> None:
        """Drafter context K/V for the first counts[b] rows (the committed ones)."""
        b = make_batch(starts, counts, block_tables, features.shape[1], runner.page_size)
        groups = [runner.layout.drafter[layer.mixer.layer_type] for layer in self.drafter.layers]
        self.drafter.write_context(features, b.positions, b.slot_mapping, groups, runner.drafter_cache)
