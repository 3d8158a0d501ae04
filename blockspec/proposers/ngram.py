"""Prompt-lookup (n-gram) drafting, vLLM's `ngram` method: the baseline proposer. The drafts
continue the latest earlier occurrence of the sequence's longest matching suffix. They are made on
the host, before the step; their distribution q is a point mass, so speculative sampling stays
exact."""

from typing import TYPE_CHECKING

import numpy as np

from blockspec.proposers.base import Proposal, Proposer

if TYPE_CHECKING:
    from blockspec.engine.runner import ModelRunner
    from blockspec.engine.step import StepInputs


def lookup(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # occurrences ending before the suffix
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if len(hits):
            start = hits[-1] + n
            return tokens[start : start + k].tolist()
    return []


class NgramProposer(Proposer):
    on_device = False

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max

    def host_drafts(self, token_ids: list[list[int]], widths: list[int]) -> list[list[int]]:
        return [lookup(np.asarray(t), self.n_min, self.n_max, w - 1) for t, w in zip(token_ids, widths)]

    def propose(self, runner: "ModelRunner", inputs: "StepInputs") -> Proposal:
        return Proposal(inputs.tokens[:, 1:])
