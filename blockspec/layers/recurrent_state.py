"""Per-sequence recurrent state of linear-attention layers, beside the paged KV cache.

Each running sequence holds a state slot (`engine.kv_cache.SlotAllocator`); a layer keeps its
states in pools indexed by slot (slot 0 is the trash slot of padding sequences). A forward reads
each sequence's state at its first row (zero where the sequence starts at position 0) and advances
it over the sequence's rows. A prefill, and a step of one row (always committed), writes the state
after all of them at once. A verify
cannot: only its accepted prefix may advance the state, and that is known after the forward. So
a verify defers the write (`RecurrentStates.pending`): each layer leaves what it needs to redo
its recurrence, and `commit` replays the accepted rows from the step's initial state, inside the
step's CUDA graph. Keeping every row's state instead writes the whole state once per row (16 times
for a 16-row verify) where the replay reads it once more and writes it once; timed against each
other (`blockspec.bench.rollback_bench`), the replay is the cheaper at every batch size."""

from dataclasses import dataclass
from typing import Protocol

import torch


class PendingState(Protocol):
    """A layer's deferred state write: `commit(rows)` advances each sequence's state over its first
    rows[b] rows of the forward and writes it to the sequence's slot."""

    def commit(self, rows: torch.Tensor) -> None: ...


@dataclass
class RecurrentStates:
    slots: torch.Tensor  # [B] each sequence's state slot (trash slot 0 for padding sequences)
    starts: torch.Tensor  # [B] position of each sequence's first row: 0 starts from the zero state
    lengths: torch.Tensor  # [B] each sequence's real rows (those past it are padding)
    # None: write each sequence's state after its `lengths` rows now (a prefill, a lone-row step); a
    # list: the layers' deferred writes, for `commit` once the accepted rows are known (verify)
    pending: list[PendingState] | None = None

    @staticmethod
    def for_block(slots: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, rows: int) -> "RecurrentStates":
        """A step's, for a block of `rows` rows a sequence: several defer their writes to `commit`
        (only the accepted rows may advance the states); a lone row is always committed, so its
        forward writes them."""
        return RecurrentStates(slots, starts, lengths, pending=[] if rows > 1 else None)

    def initial(self, pool: torch.Tensor) -> torch.Tensor:
        """Each sequence's state from `pool` [num_slots, ...] (a copy), zero where it starts at 0."""
        fresh = (self.starts == 0).view(-1, *[1] * (pool.dim() - 1))
        return pool.index_select(0, self.slots).masked_fill_(fresh, 0)  # in place: the select is a copy

    def commit(self, rows: torch.Tensor) -> None:
        """The deferred writes, each sequence's state advanced over its first rows[b] rows (none
        where the forward wrote them)."""
        if self.pending is None:
            return
        for p in self.pending:
            p.commit(rows)
        self.pending.clear()
