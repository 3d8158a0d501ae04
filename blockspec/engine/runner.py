"""Builds the batch tensors of a step and runs the target and the drafter on them.

A batch is padded to [B, S]: row b holds lengths[b] real tokens at positions
starts[b] .. starts[b]+lengths[b]-1; padding rows write their K/V into the trash page and
their outputs are ignored."""

from dataclasses import dataclass

import torch

from blockspec.engine.kv_cache import KVCache
from blockspec.engine.sequence import Sequence
from blockspec.layers.attention import AttentionMetadata, KeyRange
from blockspec.models.dflash import DFlashDrafter
from blockspec.models.llama import CausalLM


@dataclass
class Batch:
    positions: torch.Tensor  # [B, S]
    valid: torch.Tensor  # [B, S] real rows
    block_tables: torch.Tensor  # [B, M]
    slot_mapping: torch.Tensor  # [B, S] cache slot of each row (0 for padding)
    starts: torch.Tensor  # [B] position of row 0
    ends: torch.Tensor  # [B] position after the last real row


class ModelRunner:
    def __init__(
        self,
        target: CausalLM,
        drafter: DFlashDrafter | None,
        target_cache: list[KVCache],
        drafter_cache: list[KVCache] | None,
        page_size: int,
        window: int | None = None,
    ) -> None:
        self.target, self.drafter = target, drafter
        self.target_cache, self.drafter_cache = target_cache, drafter_cache
        self.page_size = page_size
        self.window = window
        self.device = target.lm_head.weight.device
        self.capture = drafter.target_layer_ids if drafter is not None else ()

    def tensor(self, data: list) -> torch.Tensor:
        return torch.tensor(data, dtype=torch.long).to(self.device, non_blocking=True)

    def batch(self, seqs: list[Sequence], starts: list[int], lengths: list[int]) -> Batch:
        width = max(lengths)
        max_pages = max(len(s.block_table) for s in seqs)
        block_tables = self.tensor([s.block_table + [0] * (max_pages - len(s.block_table)) for s in seqs])
        starts_t, lengths_t = self.tensor(starts), self.tensor(lengths)
        rows = torch.arange(width, device=self.device)
        valid = rows < lengths_t[:, None]
        positions = torch.where(valid, starts_t[:, None] + rows, 0)
        pages = block_tables.gather(1, positions // self.page_size)
        slots = torch.where(valid, pages * self.page_size + positions % self.page_size, 0)
        return Batch(positions, valid, block_tables, slots, starts_t, starts_t + lengths_t)

    def causal_range(self, b: Batch, window: int | None = None) -> KeyRange:
        start = (b.positions - window + 1).clamp_min(0) if window is not None else torch.zeros_like(b.positions)
        return start, b.positions + 1

    def run_target(self, input_ids: torch.Tensor, b: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        attn = AttentionMetadata(
            b.block_tables, b.slot_mapping, {"full_attention": self.causal_range(b)}, self.page_size
        )
        return self.target(input_ids, b.positions, attn, self.target_cache, self.capture)

    def write_context(self, b: Batch, features: torch.Tensor | None, counts: torch.Tensor) -> None:
        """Drafter context K/V for the first counts[b] rows of each sequence (committed rows)."""
        if self.drafter is None:
            return
        rows = torch.arange(features.shape[1], device=self.device) < counts[:, None]
        self.drafter.write_context(features[rows], b.positions[rows], b.slot_mapping[rows], self.drafter_cache)

    def pad(self, token_lists: list[list[int]]) -> torch.Tensor:
        width = max(len(t) for t in token_lists)
        return self.tensor([t + [0] * (width - len(t)) for t in token_lists])

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence]) -> None:
        """Process every token but the anchor; fills target KV and drafter context."""
        tokens = [s.pending_prefill for s in seqs]
        lengths = [len(t) for t in tokens]
        b = self.batch(seqs, [s.num_cached for s in seqs], lengths)
        _, features = self.run_target(self.pad(tokens), b)
        self.write_context(b, features, self.tensor(lengths))
        for s, n in zip(seqs, lengths):
            s.num_cached += n

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], widths: list[int]) -> torch.Tensor:
        """Drafter logits for block rows 1..S-1: [B, S-1, V]."""
        d = self.drafter
        b = self.batch(seqs, [s.num_cached for s in seqs], widths)
        block_ids = torch.full(b.positions.shape, d.mask_token_id, dtype=torch.long, device=self.device)
        block_ids[:, 0] = self.tensor([s.anchor for s in seqs])
        ctx_start = (b.starts - self.window).clamp_min(0) if self.window is not None else torch.zeros_like(b.starts)
        block_range = (ctx_start[:, None].expand_as(b.positions), b.ends[:, None].expand_as(b.positions))
        ranges = {"full_attention": block_range, "sliding_attention": self.causal_range(b, d.sliding_window)}
        attn = AttentionMetadata(b.block_tables, b.slot_mapping, ranges, self.page_size)
        hidden = d(self.target.embed(block_ids), b.positions, attn, self.drafter_cache)
        return d.adjust_logits(self.target.compute_logits(hidden[:, 1:]))

    @torch.inference_mode()
    def verify(
        self, seqs: list[Sequence], block_ids: torch.Tensor, widths: list[int]
    ) -> tuple[torch.Tensor, Batch, torch.Tensor | None]:
        """Target logits [B, S, V] for the block rows, the batch and its context features."""
        b = self.batch(seqs, [s.num_cached for s in seqs], widths)
        hidden, features = self.run_target(block_ids, b)
        return self.target.compute_logits(hidden), b, features
