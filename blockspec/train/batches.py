"""Which examples each step trains on, and their padded tensors.

The order is a function of (seed, step) alone: a fresh seeded permutation per epoch, cut into
batches of similar lengths (less padding), the batches shuffled. Resuming needs only the step."""

import random
from dataclasses import dataclass

import torch

from blockspec.train.data import Example

GROUP = 32  # batches whose examples are sorted by length together


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] prompt + response, right-padded with 0
    lengths: torch.Tensor  # [B] real tokens
    prompt_lengths: torch.Tensor  # [B]


def padded_width(examples: list[Example], multiple: int = 1) -> int:
    """The longest example, rounded up to `multiple` (fewer distinct shapes on the GPU)."""
    return -(-max(e.length for e in examples) // multiple) * multiple


def collate(examples: list[Example], device: torch.device, width: int | None = None) -> Batch:
    """Right-pad to `width` (default: the longest example)."""
    width = width or padded_width(examples)
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    for row, e in enumerate(examples):
        ids[row, : e.length] = torch.tensor(e.prompt_ids + e.response_ids)
    lengths = torch.tensor([e.length for e in examples])
    prompt_lengths = torch.tensor([len(e.prompt_ids) for e in examples])
    return Batch(ids.to(device), lengths.to(device), prompt_lengths.to(device))


class BatchOrder:
    def __init__(self, lengths: list[int], batch_size: int, seed: int) -> None:
        self.lengths, self.seed = lengths, seed
        self.batch_size = min(batch_size, len(lengths))
        self.per_epoch = len(lengths) // self.batch_size  # the remainder waits for another permutation
        self.epoch, self.batches = -1, []

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        rng = random.Random(self.seed * 1_000_003 + epoch)
        order = rng.sample(range(len(self.lengths)), len(self.lengths))
        order = order[: self.per_epoch * self.batch_size]
        span = GROUP * self.batch_size
        for start in range(0, len(order), span):
            order[start : start + span] = sorted(order[start : start + span], key=self.lengths.__getitem__)
        batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        rng.shuffle(batches)
        return batches

    def __call__(self, step: int) -> list[int]:
        epoch, index = divmod(step, self.per_epoch)
        if epoch != self.epoch:
            self.epoch, self.batches = epoch, self.epoch_batches(epoch)
        return self.batches[index]
