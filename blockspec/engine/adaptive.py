"""Adaptive block width: each step verifies the width (a power of two up to the engine's widest
block) that maximises expected committed tokens per second of step time.

A step of width w commits E(w) = 1 + p1 + p1*p2 + ... (w-1 terms) tokens per sequence, where
p_k is the running rate at which draft k is accepted given drafts 1..k-1 were (decayed counts,
shrunk toward the rate pooled over all positions). Its cost is the measured wall time of steps
of that width at that batch bucket. Where verifying 16 rows costs about what 1 row costs (a GPU
at small batch) the widest block wins; where rows cost compute (a CPU, or a GPU at large batch)
narrower blocks can win. Widths not yet timed at a bucket are tried from the widest down while
narrowing still saves time, and every `REEXPLORE` steps one step runs at full width, so the
acceptance rates of the far positions stay current. The width never changes the output (in
exact arithmetic), only the speed."""

import numpy as np

from blockspec.engine.cuda_graphs import BATCH_BUCKETS, round_up

DECAY = 0.99  # per step, on acceptance counts: about the last hundred steps count
COST_EMA = 0.1  # weight of a new step-time sample
REEXPLORE = 64  # steps between full-width steps
PRIOR = 4.0  # weight, in steps, of the pooled acceptance rate in each position's rate
SAVING = 0.9  # narrower widths are tried only while halving the width cut the step time below this


def width_classes(max_width: int) -> tuple[int, ...]:
    """1, 2, 4, ... and max_width: the widths steps run at (and CUDA graphs are captured for)."""
    return tuple(sorted({min(2**i, max_width) for i in range(max_width.bit_length() + 1)}))


class AdaptiveWidth:
    def __init__(self, max_width: int) -> None:
        self.classes = width_classes(max_width)
        self.hits = np.zeros(max_width - 1)  # decayed count of draft k accepted, k = 1..max_width-1
        self.trials = np.zeros(max_width - 1)  # decayed count of draft k reached
        self.cost: dict[tuple[int, int], float] = {}  # (bucket, width) -> seconds per step
        self.seen: set[tuple[int, int]] = set()  # first step of a key is warm-up (graph capture)
        self.steps = 0

    def expected_tokens(self) -> np.ndarray:
        """E(w) for every width w = 1 .. max (index w - 1)."""
        # Each position's rate leans on the pooled rate of all positions where its own counts are
        # few: far positions, seen only at full width, are not pulled toward an arbitrary prior.
        pooled = (self.hits.sum() + 1) / (self.trials.sum() + 2)
        rates = (self.hits + PRIOR * pooled) / (self.trials + PRIOR)
        return 1 + np.concatenate([[0.0], np.cumsum(np.cumprod(rates))])

    def row_class(self, rows: int) -> int:
        return round_up(rows, self.classes)

    def choose(self, batch: int) -> int:
        bucket = round_up(batch, BATCH_BUCKETS)
        timed = [w for w in reversed(self.classes) if (bucket, w) in self.cost]  # widest first
        if len(timed) < len(self.classes):
            costs = [self.cost[bucket, w] for w in timed[-2:]]
            if len(costs) < 2 or costs[1] < SAVING * costs[0]:  # narrowing still pays: try the next
                return next(w for w in reversed(self.classes) if w not in timed)
        if self.steps % REEXPLORE == 0:
            return self.classes[-1]
        expected = self.expected_tokens()
        return max(timed, key=lambda w: expected[w - 1] / self.cost[bucket, w])

    def observe(
        self, batch: int, width: int | None, seconds: float | None, offered: list[int], accepted: list[int]
    ) -> None:
        """One step: its batch, the width chosen and the step's wall time (None: not a timing of
        that width), and per sequence the drafts offered and accepted."""
        self.steps += 1
        key = (round_up(batch, BATCH_BUCKETS), width)
        if seconds is not None:
            if key in self.seen:
                old = self.cost.get(key, seconds)
                self.cost[key] = old + COST_EMA * (seconds - old)
            self.seen.add(key)
        # Draft k+1 (index k) of a sequence offered n and accepting a was reached if k < min(a+1, n),
        # accepted if k < a.
        k, n, a = np.arange(len(self.hits))[None], np.asarray(offered)[:, None], np.asarray(accepted)[:, None]
        self.trials = DECAY * self.trials + (k < np.minimum(a + 1, n)).sum(0)
        self.hits = DECAY * self.hits + (k < a).sum(0)
