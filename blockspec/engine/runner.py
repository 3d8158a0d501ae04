"""Runs the target and the drafter on a batch of sequences.

A forward's only inputs are, per sequence, `starts` (position of its first row), `lengths`
(its real rows) and its `block_tables` row; positions, cache slots and visible key ranges
are derived from them on the device (`make_batch`), so the same forward can be captured in
a CUDA graph and replayed with new inputs. Rows past a sequence's length are padding: they
write K/V into the trash page and their outputs are ignored."""

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from blockspec.engine.cuda_graphs import GraphCache
from blockspec.engine.kv_cache import KVCache
from blockspec.engine.sequence import Sequence
from blockspec.layers.attention import AttentionMetadata, KeyRange
from blockspec.layers.fast_path import cuda_compiled
from blockspec.models.dflash import DFlashDrafter
from blockspec.models.llama import CausalLM


@dataclass
class Batch:
    positions: torch.Tensor  # [B, S]
    block_tables: torch.Tensor  # [B, M]
    slot_mapping: torch.Tensor  # [B, S] cache slot of each row (trash slot 0 for padding)
    starts: torch.Tensor  # [B] position of row 0
    ends: torch.Tensor  # [B] position after the last real row


@cuda_compiled
def batch_rows(
    starts: torch.Tensor, lengths: torch.Tensor, block_tables: torch.Tensor, width: int, page_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Positions and cache slots [B, width] of each sequence's rows (padding rows, past its
    length: position 0, trash slot 0) and the position after its last real row [B]; on CUDA two
    fused launches instead of eleven (H200: each a microsecond or two of a step's critical path)."""
    rows = torch.arange(width, device=starts.device)
    valid = rows < lengths[:, None]
    positions = torch.where(valid, starts[:, None] + rows, 0)
    pages = block_tables.gather(1, positions // page_size)
    slots = torch.where(valid, pages * page_size + positions % page_size, 0)
    return positions, slots, starts + lengths


def make_batch(
    starts: torch.Tensor, lengths: torch.Tensor, block_tables: torch.Tensor, width: int, page_size: int
) -> Batch:
    positions, slots, ends = batch_rows(starts, lengths, block_tables, width, page_size)
    return Batch(positions, block_tables, slots, starts, ends)


@cuda_compiled
def causal_range(positions: torch.Tensor) -> KeyRange:
    return torch.zeros_like(positions), positions + 1


@cuda_compiled  # apart from causal_range: each compiled function has 8 shape variants before eager
def window_range(positions: torch.Tensor, window: int) -> KeyRange:
    return (positions - window + 1).clamp_min(0), positions + 1


def key_ranges(b: Batch, full: KeyRange, window: int | None) -> dict[str, KeyRange]:
    """Each layer type's visible keys: `full` for full attention, and for sliding layers, where
    the model has them (`window` not None), the causal window."""
    return {"full_attention": full} | (
        {"sliding_attention": window_range(b.positions, window)} if window is not None else {}
    )


class ModelRunner:
    def __init__(
        self,
        target: CausalLM,
        drafter: DFlashDrafter | None,
        target_cache: list[KVCache],
        drafter_cache: list[KVCache] | None,
        page_size: int,
        window: int | None = None,
        graphs: GraphCache | None = None,
        max_model_len: int = 2**62,
    ) -> None:
        self.target, self.drafter = target, drafter
        self.target_cache, self.drafter_cache = target_cache, drafter_cache
        self.page_size = page_size
        self.window = window
        self.graphs = graphs
        self.max_model_len = max_model_len  # positions a drafter block may write stay below it
        self.device = target.lm_head.weight.device
        self.capture = drafter.target_layer_ids if drafter is not None else ()
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def tensor(self, data: list | np.ndarray) -> torch.Tensor:
        """Host integers on the device. On CUDA copied on a stream of its own, which the current one
        waits for: a step launched ahead is queued while the step before runs, and its inputs then
        cross during that step instead of after it, between the two steps' graphs."""
        host = torch.as_tensor(np.asarray(data, dtype=np.int64))
        if self.device.type != "cuda":
            return host
        with torch.cuda.stream(self.copy_stream):  # allocated there, so no pending kernel still reads the memory
            device = host.pin_memory().to(self.device, non_blocking=True)
        current = torch.cuda.current_stream()
        current.wait_stream(self.copy_stream)
        device.record_stream(current)  # not reused before the current stream is done with it
        return device

    def to_host(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Start copying x to the host; the copy is complete once the event (None on the CPU) passed."""
        if self.device.type != "cuda":
            return x.clone(), None  # x may be a graph's output, which its next replay overwrites
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        host.copy_(x, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return host, ready

    def tensors(self, *arrays: list | np.ndarray) -> list[torch.Tensor]:
        """Host integer arrays to the device in one copy (each copy adds its latency to a step's
        critical path), as views of it, each 16-byte aligned (as kernels specialize)."""
        host = [np.asarray(a, dtype=np.int64).ravel() for a in arrays]
        padded = [np.pad(h, (0, h.size % 2)) for h in host]  # even lengths: 16-byte aligned views
        flat = self.tensor(np.concatenate(padded))
        parts = flat.split([p.size for p in padded])
        return [part[: h.size].view(np.shape(a)) for part, h, a in zip(parts, host, arrays)]

    @staticmethod
    def host_block_tables(seqs: list[Sequence]) -> np.ndarray:
        """[B, M] page ids padded with the trash page, M the most pages a sequence holds: the
        host cost and the copy follow the pages in use, not the context limit."""
        tables = np.zeros((len(seqs), max(len(s.block_table) for s in seqs)), dtype=np.int64)
        for row, s in zip(tables, seqs):
            row[: len(s.block_table)] = s.block_table
        return tables

    def num_graphs(self) -> int:
        """CUDA graphs captured so far (a capture synchronizes the device and compiles)."""
        return len(self.graphs.graphs) if self.graphs is not None else 0

    def run(self, name: str, fn, *inputs: torch.Tensor):
        """fn(*inputs) eagerly, or as a CUDA graph replay when graphs are on."""
        if self.graphs is None:
            return fn(*inputs)
        return self.graphs.run(name, fn, inputs)

    # -- device-only forwards (capturable) --

    def target_forward(self, input_ids, starts, lengths, block_tables):
        b = make_batch(starts, lengths, block_tables, input_ids.shape[1], self.page_size)
        ranges = key_ranges(b, causal_range(b.positions), self.target.sliding_window)
        attn = AttentionMetadata(b.block_tables, b.slot_mapping, ranges, self.page_size, b.starts)
        hidden, features = self.target(input_ids, b.positions, attn, self.target_cache, self.capture)
        return hidden, features

    def verify_forward(self, block_ids, starts, lengths, block_tables):
        hidden, features = self.target_forward(block_ids, starts, lengths, block_tables)
        return self.target.compute_logits(hidden), features

    def propose_forward(self, anchors, starts, lengths, block_tables):
        """Drafter logits [B, w-1, V] of block rows 1..w-1; `anchors` [B, w]: each block's anchor,
        repeated w times (the width sets the rows kept, and the CUDA graph's row class). The
        drafter runs its whole block, [anchor, MASK, ...] over `lengths` rows (the block size where
        the context has room), the layout it was trained on: cut to w rows, the same drafts come
        out less accurate (the shipped SmolLM2 drafter's first draft: 36% right at w = 2 against
        48% at 16, fp32)."""
        d = self.drafter
        width = anchors.shape[1]
        full = F.pad(anchors[:, :1], (0, d.block_size - 1), value=d.mask_token_id)
        b = make_batch(starts, lengths, block_tables, d.block_size, self.page_size)
        ctx_start = (b.starts - self.window).clamp_min(0) if self.window is not None else torch.zeros_like(b.starts)
        block_range = (ctx_start[:, None].expand_as(b.positions), b.ends[:, None].expand_as(b.positions))
        attn = AttentionMetadata(
            b.block_tables, b.slot_mapping, key_ranges(b, block_range, d.sliding_window), self.page_size, b.starts
        )
        hidden = d(self.target.embed(full), b.positions, attn, self.drafter_cache)
        return d.compute_logits(hidden[:, 1:width], self.target)

    def context_forward(self, features, starts, counts, block_tables):
        """Drafter context K/V for the first counts[b] rows (the committed ones)."""
        b = make_batch(starts, counts, block_tables, features.shape[1], self.page_size)
        self.drafter.write_context(features, b.positions, b.slot_mapping, self.drafter_cache)
        return ()

    # -- host-facing steps --

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence]) -> None:
        """Process every token but the anchor; fills target KV and drafter context."""
        tokens = [s.pending_prefill for s in seqs]
        lengths = [len(t) for t in tokens]
        width = max(lengths)
        ids, starts, lengths_t, tables = self.tensors(
            [t + [0] * (width - len(t)) for t in tokens],
            [s.num_cached for s in seqs],
            lengths,
            self.host_block_tables(seqs),
        )
        _, features = self.target_forward(ids, starts, lengths_t, tables)  # eager: prompt shapes vary
        if self.drafter is not None:
            self.context_forward(features, starts, lengths_t, tables)
        for s, n in zip(seqs, lengths):
            s.num_cached += n

    def step_inputs(
        self, seqs: list[Sequence], widths: list[int], starts: torch.Tensor | None, *extra: list[int]
    ) -> tuple[tuple[torch.Tensor, ...], list[torch.Tensor]]:
        """(starts, lengths, block_tables) of a decoding step, and the `extra` per-sequence host
        lists on the device too, all in one copy. Row 0 of each block is its anchor, at `starts`
        (None: the committed lengths; a step launched ahead passes them on the device)."""
        committed = [[s.num_cached for s in seqs]] if starts is None else []
        lengths, tables, *rest = self.tensors(widths, self.host_block_tables(seqs), *extra, *committed)
        if starts is None:
            starts = rest.pop()
        return (starts, lengths, tables), rest

    @torch.inference_mode()
    def propose(self, anchors: torch.Tensor, inputs: tuple, width: int) -> torch.Tensor:
        """Drafter logits for block rows 1..width-1: [B, width-1, V]. anchors: [B, 1]. The drafter
        runs its whole block, up to the context's end (the engine holds pages for it)."""
        starts, _, tables = inputs
        return self.run(
            "propose", self.propose_forward, anchors.expand(-1, width), starts, self.block_lengths(starts), tables
        )

    def block_lengths(self, starts: torch.Tensor) -> torch.Tensor:
        """Rows of each drafter block anchored at `starts`: its block size, up to the context's end."""
        return (self.max_model_len - starts).clamp_max(self.drafter.block_size)

    @torch.inference_mode()
    def verify(self, block_ids: torch.Tensor, inputs: tuple) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Target logits [B, S, V] for the block rows and their context features."""
        return self.run("verify", self.verify_forward, block_ids, *inputs)

    @torch.inference_mode()
    def commit_context(self, features: torch.Tensor | None, inputs: tuple, counts: torch.Tensor) -> None:
        if self.drafter is not None:
            starts, _, tables = inputs
            self.run("context", self.context_forward, features, starts, counts, tables)
