"""Adaptive block width: each step verifies the width (a power of two up to the engine's widest
block) that maximises expected committed tokens per second of step time.

A step of width w commits E(w) = 1 + p1 + p1*p2 + ... (w-1 terms) tokens per sequence, where
p_k is the running rate at which draft k is accepted given drafts 1..k-1 were (decayed counts,
shrunk toward the rate pooled over all positions). Its cost is the measured wall time of steps
of that width at that batch bucket. Where verifying 16 rows costs about what 1 row costs (a GPU
at small batch) the widest block wins; where rows cost compute (a CPU, or a GPU at large batch)
narrower blocks can win, and where drafts are seldom accepted width 1 (a plain step: no drafter
forward at all) can. Each bucket times every width class first, widest down, over `SAMPLES`
steps each (step times are noisy: one sample can rule a width out for good); after that a step
runs at full width now and then, so the acceptance rates of the far positions stay current, as
often as keeps their extra time within `EXPLORE_SHARE` of the time spent. The width never changes
the output (in exact arithmetic), only the speed."""

import numpy as np

from blockspec.engine.cuda_graphs import BATCH_BUCKETS, round_up

DECAY = 0.99  # per step, on acceptance counts: about the last hundred steps count
COST_EMA = 0.1  # weight of a new step-time sample
EXPLORE_SHARE = 0.01  # of the step time, at most this goes to full-width steps the policy would not choose
PRIOR = 4.0  # weight, in steps, of the pooled acceptance rate in each position's rate
SAMPLES = 3  # timed steps of each width class before the policy chooses among them


def width_classes(max_width: int) -> tuple[int, ...]:
    """1, 2, 4, ... and max_width: the widths steps run at (and CUDA graphs are captured for)."""
    return tuple(sorted({min(2**i, max_width) for i in range(max_width.bit_length() + 1)}))


class AdaptiveWidth:
    def __init__(self, max_width: int) -> None:
        self.classes = width_classes(max_width)
        self.hits = np.zeros(max_width - 1)  # decayed count of draft k accepted, k = 1..max_width-1
        self.trials = np.zeros(max_width - 1)  # decayed count of draft k reached
        self.cost: dict[tuple[int, int], float] = {}  # (bucket, width) -> seconds per step
        # (bucket, width) -> steps timed; the first is warm-up (graph capture), left out of the cost
        self.timed_steps: dict[tuple[int, int], int] = {}
        self.since_full = 0.0  # seconds of steps since the last full-width one
        self.width_steps = dict.fromkeys(self.classes, 0)  # steps run at each width class (for benchmarks)

    def expected_tokens(self) -> np.ndarray:
        """E(w) for every width w = 1 .. max (index w - 1)."""
        # Each position's rate leans on the pooled rate of all positions where its own counts are
        # few: far positions, seen only at full width, are not pulled toward an arbitrary prior.
        pooled = (self.hits.sum() + 1) / (self.trials.sum() + 2)
        rates = (self.hits + PRIOR * pooled) / (self.trials + PRIOR)
        return 1 + np.concatenate([[0.0], np.cumsum(np.cumprod(rates))])

    def row_class(self, rows: int) -> int:
        return round_up(rows, self.classes)

    def choose(self, batch: int, limit: int) -> int:
        """The width class of a step of `batch` sequences, none of which can take more than
        `limit` rows (their max_tokens or the context may cap them): wider classes could not run,
        so they are neither timed nor chosen."""
        bucket = round_up(batch, BATCH_BUCKETS)
        allowed = [w for w in self.classes if w <= self.row_class(limit)]
        untimed = [w for w in reversed(allowed) if self.timed_steps.get((bucket, w), 0) <= SAMPLES]
        if untimed:
            return untimed[0]  # widest first
        expected = self.expected_tokens()
        best = max(allowed, key=lambda w: expected[w - 1] / self.cost[bucket, w])
        full = self.classes[-1]
        if full in allowed and self.since_full * EXPLORE_SHARE >= self.cost[bucket, full] - self.cost[bucket, best]:
            return full
        return best

    def observe(self, batch: int, width: int, seconds: float | None, offered: list[int], accepted: list[int]) -> None:
        """One step: its batch, the width class it ran and its wall time (None: not a timing of
        that width), and per sequence the drafts offered and accepted."""
        self.since_full = 0.0 if width == self.classes[-1] else self.since_full + (seconds or 0.0)
        self.width_steps[width] += 1
        key = (round_up(batch, BATCH_BUCKETS), width)
        if seconds is not None:
            n = self.timed_steps.get(key, 0)
            if n:  # the mean of the first samples, then a moving average
                old = self.cost.get(key, seconds)
                self.cost[key] = old + max(COST_EMA, 1 / n) * (seconds - old)
            self.timed_steps[key] = n + 1
        # Draft k+1 (index k) of a sequence offered n and accepting a was reached if k < min(a+1, n),
        # accepted if k < a.
        k, n, a = np.arange(len(self.hits))[None], np.asarray(offered)[:, None], np.asarray(accepted)[:, None]
        self.trials = DECAY * self.trials + (k < np.minimum(a + 1, n)).sum(0)
        self.hits = DECAY * self.hits + (k < a).sum(0)
