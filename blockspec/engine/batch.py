"""A forward's per-row tensors, derived on the device from three per-sequence inputs: `starts`
(position of its first row), `lengths` (its real rows) and its `block_tables` rows (one per cache
group). Positions, cache slots and visible key ranges follow from them, so the same forward can be
captured in a CUDA graph and replayed with new inputs. Rows past a sequence's length are padding:
they write K/V into the trash page 0 and their outputs are ignored."""

from dataclasses import dataclass

import torch

from blockspec.layers.attention import KeyRange
from blockspec.layers.fast_path import cuda_compiled


@dataclass
class Batch:
    positions: torch.Tensor  # [B, S]
    block_tables: torch.Tensor  # [B, G, M] per cache group
    slot_mapping: torch.Tensor  # [G, B, S] cache slot of each row per group (trash slot 0 for padding)
    starts: torch.Tensor  # [B] position of row 0
    ends: torch.Tensor  # [B] position after the last real row


@cuda_compiled
def batch_rows(
    starts: torch.Tensor, lengths: torch.Tensor, block_tables: torch.Tensor, width: int, page_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Positions [B, width] of each sequence's rows and their cache slots in each group [G, B,
    width] (padding rows, past its length: position 0, trash slot 0), and the position after its
    last real row [B]; compiled on CUDA, as a few fused launches on the step's critical path."""
    rows = torch.arange(width, device=starts.device)
    valid = rows < lengths[:, None]
    positions = torch.where(valid, starts[:, None] + rows, 0)
    pages = block_tables.gather(2, (positions // page_size)[:, None].expand(-1, block_tables.shape[1], -1))
    slots = torch.where(valid[:, None], pages * page_size + (positions % page_size)[:, None], 0)
    return positions, slots.transpose(0, 1).contiguous(), starts + lengths


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
