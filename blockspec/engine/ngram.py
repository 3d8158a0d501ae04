"""Prompt-lookup (n-gram) drafting, vLLM's `ngram` method: the baseline proposer. The
drafts continue the latest earlier occurrence of the sequence's longest matching suffix.
Its distribution q is a point mass, so speculative sampling stays exact."""

import numpy as np
import torch.nn.functional as F

from blockspec.engine.runner import ModelRunner
from blockspec.engine.sequence import Sequence


def lookup(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # occurrences ending before the suffix
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if len(hits):
            start = hits[-1] + n
            return tokens[start : start + k].tolist()
    return []


class NgramProposer:
    def __init__(self, n_min: int, n_max: int, vocab_size: int) -> None:
        self.n_min, self.n_max, self.vocab_size = n_min, n_max, vocab_size

    def __call__(self, runner: ModelRunner, seqs: list[Sequence], widths: list[int], anchors, inputs):
        """Drafts [B, S-1], their point-mass q for sampled sequences, and the widths they fill."""
        found = [lookup(np.asarray(s.token_ids), self.n_min, self.n_max, w - 1) for s, w in zip(seqs, widths)]
        width = max(len(d) for d in found)
        drafts = runner.tensor([d + [0] * (width - len(d)) for d in found]).view(len(seqs), width)
        q = [
            None if s.params.greedy else F.one_hot(drafts[i, : len(d)], self.vocab_size).float()
            for i, (s, d) in enumerate(zip(seqs, found))
        ]
        return drafts, q, [len(d) + 1 for d in found]
