"""Adaptive block width: each step verifies the width (a power of two up to the engine's widest
block) that maximises expected committed tokens per second of step time.

A step of width w commits E(w) = 1 + p1 + p1*p2 + ... (w-1 terms) tokens per sequence, where
p_k is the running rate at which draft k is accepted given drafts 1..k-1 were (decayed counts,
shrunk toward the rate pooled over all positions); the step's sequences each have their own
rates, shrunk toward those (a batch whose easy requests have finished keeps its hard ones: the
rates of all past steps would overrate it). Its cost is measured, per batch bucket. Where
verifying 16 rows costs about what 1 row costs (a GPU at small batch) the widest block wins; where
rows cost compute (a CPU, or a GPU at large batch) narrower blocks can win, and where drafts are
seldom accepted width 1 (a plain step: no drafter forward at all) can (once drafts have been
seen: a plain step shows none, and the prior's rates alone are no evidence against drafting).

Step times drift: contexts grow, and a machine's load comes and goes, so two widths timed
minutes apart differ by more than their own costs do. Widths are therefore compared by the ratio
of their step time to the current width's, each measured beside it: the current width's time
follows its recent steps, and every other width is timed again now and then, in the step after
one of the current width's, as often as keeps the time it is expected to lose within
`EXPLORE_SHARE` of all step time. A bucket first runs each width once untimed where that step
builds something (a CUDA graph), then times each up to `SAMPLES` times, each step beside one of
the narrowest (the cheapest), unless the engine timed its steps when it started (`start_from`).
Those times leave out the host's commits, which every width pays alike, so where the host bounds
a step they set widths too far apart: a width's first live timing replaces its start time, and a
close rival still timed only at the start is timed live at its first chance. The width never changes the output (in exact arithmetic), only
the speed.

Where the drafter predicts each draft's chance of acceptance (a DSpark confidence head), a
sequence's rates are the confidences of its latest drafts, calibrated per position against the
acceptances seen (the confidences of drafts reached and how many of those were accepted, decayed
as the counts are): they follow each sequence from step to step where counts follow it over a
hundred. They are the drafts of a step already read, never those of the step being sized, as
DSpark's production scheduler does (so no draft is kept by a confidence that reads it).

Where steps run ahead (CUDA), a step's wall time is not its own: the host commits the step
before it and launches the step after it while the device runs it, and on a fast device that
host work is most of the time. A timing therefore counts only where both those neighbours ran
its width, and the policy runs every width it chooses RUN_AHEAD_RUN steps in a row, a bucket's
first run of each SAMPLES steps longer (its warm-up, where it has one, and first timings in one run)."""

from dataclasses import dataclass, field

import numpy as np

from blockspec.engine.cuda_graphs import BATCH_BUCKETS, round_up

DECAY = 0.99  # per step that drafts, on acceptance counts: about the last hundred such steps count
LEVEL_EMA = 0.3  # weight of a new step time in the current width's: it follows the drift
RATIO_EMA = 0.2  # weight of a new sample in another width's ratio, after its first SAMPLES
EXPLORE_SHARE = 0.01  # of the step time, at most this goes to widths the policy would not choose
PRIOR = 4.0  # weight, in steps, of the pooled acceptance rate in each position's rate
ROW_PRIOR = 4.0  # weight, in drafts reached, of all sequences' rate in one sequence's rate
VERIFY_LOSS = 0.25  # of a step: a close rival whose time is the start's alone is timed live at once
SAMPLES = 3  # timed steps of each width class before the policy chooses among them
HOPELESS = 0.5  # of the best timed width's speed: a width slower than this is timed no more at first
RUN_AHEAD_RUN = 3  # steps in a row where steps run ahead: the middle one holds only its own host work


def first_run_length(run_length: int) -> int:
    """Steps of a bucket's first run of a width: where runs are longer than one step, its warm-up
    and SAMPLES timings inside one run; else one step (the timings follow beside the narrowest)."""
    return run_length + SAMPLES if run_length > 1 else 1


def is_timing(width: int, seconds: float | None, beside: tuple[int | None, ...]) -> bool:
    """Whether a step's wall time times its width class: it has one (None: not a timing; a zero
    would make no ratio) and the host work in it was of steps of the same width (`beside`)."""
    return bool(seconds) and all(w in (None, width) for w in beside)


def width_classes(max_width: int) -> tuple[int, ...]:
    """1, 2, 4, ... and max_width: the widths steps run at (and CUDA graphs are captured for)."""
    return tuple(sorted({min(2**i, max_width) for i in range(max_width.bit_length() + 1)}))


@dataclass
class BucketCosts:
    """Step times at one batch bucket: `seconds` per step at the `current` width (a moving
    average of its recent steps), every timed width's step time as a `ratio` to it."""

    current: int | None = None
    seconds: float | None = None
    ratio: dict[int, float] = field(default_factory=dict)
    steps: dict[int, int] = field(default_factory=dict)  # steps of each width, a warm-up included
    since: dict[int, float] = field(default_factory=dict)  # seconds of steps since each width last ran
    last: int | None = None  # the width of the last timed step
    repeat: int | None = None  # the width of the run of steps under way
    repeats: int = 0  # steps of it still due
    started: set[int] = field(default_factory=set)  # widths whose times are the start's (`start_from`) alone
    captures: bool = True  # a width's first step builds what it runs (a CUDA graph): no timing

    def rebase(self, width: int) -> None:
        """Make `width` the current one: its estimated time the level, the ratios relative to it."""
        r = self.ratio[width]
        self.seconds *= r
        self.ratio = {w: x / r for w, x in self.ratio.items()}
        self.current = width

    def record(self, width: int, seconds: float) -> None:
        """A step of `width` took `seconds`: its width's first step is a warm-up (graph capture)
        where the bucket has one and not a timing; the current width's moves the level, any other's
        its ratio. A width's first live timing replaces a time from the start, which left out the
        host's commits."""
        for w in self.since:
            self.since[w] += seconds
        self.since[width] = 0.0
        self.steps[width] = self.steps.get(width, 0) + 1
        n = self.timings(width)
        if n == 0:
            return
        first = width in self.started
        self.started.discard(width)
        if width == self.current:
            level = self.seconds is None or first
            self.seconds = seconds if level else self.seconds + LEVEL_EMA * (seconds - self.seconds)
        elif self.seconds is not None:
            sample = seconds / self.seconds
            old = self.ratio.get(width, sample)
            self.ratio[width] = old + (1.0 if first else max(RATIO_EMA, 1 / n)) * (sample - old)
        self.last = width

    def timings(self, width: int) -> int:
        """The steps of `width` that timed it (all but a warm-up)."""
        n = self.steps.get(width, 0)
        return max(n - 1, 0) if self.captures else n


@dataclass
class AcceptCounts:
    """Decayed counts of draft k (index k - 1) reached ([..., 0, k - 1]) and accepted ([..., 1,
    k - 1]): [2, positions] for all sequences, or [slots, 2, positions], a row per sequence. One
    array, so that a step's update is a few whole-array operations (it runs on the host between
    steps)."""

    counts: np.ndarray

    @classmethod
    def zeros(cls, *shape: int) -> "AcceptCounts":
        return cls(np.zeros((*shape[:-1], 2, shape[-1])))

    @property
    def trials(self) -> np.ndarray:
        return self.counts[..., 0, :]

    @property
    def hits(self) -> np.ndarray:
        return self.counts[..., 1, :]

    def add(self, seen: np.ndarray) -> None:
        """One step's `drafts_seen`, summed over its sequences."""
        self.counts *= DECAY
        self.counts += seen

    def add_rows(self, seen: np.ndarray, slots: list[int]) -> None:
        """One step's `drafts_seen` [sequences, 2, positions], each into its slot's row."""
        rows = self.counts[slots]
        rows *= DECAY
        rows += seen
        self.counts[slots] = rows


def drafts_seen(offered: list[int], accepted: list[int], positions: int) -> np.ndarray:
    """[sequences, 2, positions]: draft k+1 (index k) of a sequence offered n drafts that accepted a
    of them was reached if k < min(a+1, n), accepted if k < a."""
    accepted = np.asarray(accepted)
    reached = np.minimum(accepted + 1, offered)
    return np.arange(positions) < np.stack([reached, accepted], 1)[:, :, None]


def with_chances(seen: np.ndarray, chances: list[np.ndarray | None]) -> np.ndarray:
    """`drafts_seen` [sequences, 2, positions] with the drafts reached of each sequence that has
    `chances` counted as accepted by those (floats), the others by their outcomes."""
    given = [i for i, c in enumerate(chances) if c is not None and len(c)]
    if not given:
        return seen
    lengths = np.minimum([len(chances[i]) for i in given], seen.shape[-1])
    rows = np.repeat(given, lengths)
    cols = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    given_chances = np.concatenate([chances[i][:n] for i, n in zip(given, lengths)])
    seen = seen.astype(float)
    seen[rows, 1, cols] = np.where(seen[rows, 0, cols] > 0, given_chances, 0.0)
    return seen


class AdaptiveWidth:
    def __init__(self, max_width: int, run_length: int = 1, captures: bool = True) -> None:
        self.classes = width_classes(max_width)
        self.run_length = run_length  # steps in a row at each width chosen
        self.captures = captures  # a bucket's first step of a width builds what it runs (a CUDA graph)
        self.counts = AcceptCounts.zeros(max_width - 1)  # all sequences'
        self.own = AcceptCounts.zeros(0, max_width - 1)  # each running sequence's, at its slot
        self.slots: dict[str, int] = {}  # request id -> its row of `own`
        self.free: list[int] = []  # rows of `own` that finished sequences left
        self.costs: dict[int, BucketCosts] = {}  # batch bucket -> its step times
        self.width_steps = dict.fromkeys(self.classes, 0)  # steps run at each width class (for benchmarks)
        self.estimates: tuple[tuple[str, ...], np.ndarray] | None = None  # (rows, E(w)) last computed
        # [0, k]: confidences of draft k+1 where reached, [1, k]: those accepted (all sequences')
        self.calibration = AcceptCounts.zeros(max_width - 1)
        self.confidence: dict[str, np.ndarray] = {}  # request id -> its latest drafts' confidences (NaN: none)

    def start_from(self, seconds: dict[int, dict[int, float]]) -> None:
        """Step times measured before any request (`step_costs`), per batch bucket and width
        class: a bucket given them counts every width as timed and chooses from its first step,
        the widest its current width; its live steps go on timing them as any bucket's do."""
        for batch, times in seconds.items():
            costs, widest = self.bucket(batch), max(times)
            costs.current, costs.seconds = widest, times[widest]
            costs.ratio = {w: s / times[widest] for w, s in times.items()}
            costs.steps = dict.fromkeys(times, SAMPLES + costs.captures)
            costs.since = dict.fromkeys(times, 0.0)
            costs.started = set(times)

    def expected_tokens(self, rows: list[str] = ()) -> np.ndarray:
        """E(w) for every width w = 1 .. max (index w - 1), the mean of the sequences `rows`'
        (none: of any sequence). Kept until the counts or the rows change: over a run of plain
        steps neither does."""
        key = tuple(rows)
        if self.estimates is None or self.estimates[0] != key:
            self.estimates = key, self.estimate(rows)
        return self.estimates[1]

    def estimate(self, rows: list[str]) -> np.ndarray:
        """`expected_tokens`, computed."""
        # Each position's rate leans on the pooled rate of all positions where its own counts are
        # few: far positions, seen only at full width, are not pulled toward an arbitrary prior.
        trials, hits = self.counts.counts.sum(1)
        pooled = (hits + 1) / (trials + 2)
        rates = (self.counts.hits + PRIOR * pooled) / (self.counts.trials + PRIOR)
        known = [r for r in rows if r in self.slots]
        if known:  # [R, positions]: each sequence's rates, leaning on all sequences' where its counts are few
            own = self.own.counts[[self.slots[r] for r in known]]
            rates = (own[:, 1] + ROW_PRIOR * rates) / (own[:, 0] + ROW_PRIOR)
            if any(r in self.confidence for r in known):
                rates = self.confident_rates(rates, known)
        expected = np.ones(rates.shape[-1] + 1)
        expected[1:] += np.cumprod(np.atleast_2d(rates), axis=1).cumsum(axis=1).mean(0)
        return expected

    def confident_rates(self, rates: np.ndarray, rows: list[str]) -> np.ndarray:
        """rates [R, positions] of the sequences `rows`, where their latest drafts have confidences
        those, scaled per position by the acceptances seen over the confidences of drafts reached
        (the scale leans on 1, trusting the head, where few were)."""
        latest = np.stack([self.confidence.get(r, np.full(rates.shape[-1], np.nan)) for r in rows])
        predicted, accepted = self.calibration.counts
        scaled = np.minimum(latest * (accepted + PRIOR) / (predicted + PRIOR), 1.0)
        return np.where(np.isnan(latest), rates, scaled)

    def row_class(self, rows: int) -> int:
        return round_up(rows, self.classes)

    def bucket(self, batch: int) -> BucketCosts:
        return self.costs.setdefault(round_up(batch, BATCH_BUCKETS), BucketCosts(captures=self.captures))

    def choose(self, batch: int, limit: int, rows: list[str] = ()) -> int:
        """The width class of a step of `batch` sequences (their request ids `rows`), none of which
        can take more than `limit` rows (their max_tokens or the context may cap them): wider
        classes could not run, so they are neither timed nor chosen."""
        costs, widest = self.bucket(batch), self.row_class(limit)
        allowed = [w for w in self.classes if w <= widest]
        if len(allowed) == 1:
            return allowed[0]
        if costs.repeats and costs.repeat in allowed:
            costs.repeats -= 1
            return costs.repeat
        width = self.next_width(costs, allowed, rows)
        run = first_run_length(self.run_length) if width not in costs.steps else self.run_length
        costs.repeat, costs.repeats = width, run - 1
        return width

    def next_width(self, costs: BucketCosts, allowed: list[int], rows: list[str]) -> int:
        """The width of the next run of steps: the first timings, else the best, or another due a timing."""
        first = self.first_timings(costs, allowed, rows)
        if first is not None:
            return first
        expected = self.expected_tokens(rows=rows)
        # Until drafts have been seen the rates are the prior's, which are no evidence against drafting,
        # and a plain step would never show what drafts are accepted
        drafting = allowed if self.counts.trials[0] >= PRIOR else allowed[1:]
        best = max(drafting, key=lambda w: expected[w - 1] / costs.ratio[w])
        if costs.current not in allowed:  # rows capped below the current width: a request's last steps
            return best
        if best != costs.current:
            costs.rebase(best)
        return best if costs.last != best else self.retime(costs, allowed, best, expected)

    def first_timings(self, costs: BucketCosts, allowed: list[int], rows: list[str]) -> int | None:
        """The width of a bucket's next run while its widths are not all timed: where a first step
        is a warm-up or runs are longer than one step, a first run of each, narrowest first
        (`first_run_length`); then, until each has SAMPLES timings, runs of each beside runs of the
        narrowest (the cheapest step), a timing of every width before a second of any, widest first.
        A `hopeless` width is timed no more (a full block of many rows on a CPU: one step costs
        several plain ones)."""
        if costs.current is None:
            costs.current, costs.ratio[allowed[0]] = allowed[0], 1.0
        cold = [w for w in allowed if w not in costs.steps]
        if cold and (costs.captures or self.run_length > 1):
            return cold[0]
        untimed = [w for w in reversed(allowed) if w not in costs.ratio or costs.timings(w) < SAMPLES]
        if untimed:
            hopeless = self.hopeless(costs, allowed, rows)
            untimed = [w for w in untimed if w not in hopeless]
        if costs.current in allowed and (costs.seconds is None or (untimed and costs.last != costs.current)):
            return costs.current
        return min(untimed, key=costs.timings, default=None)

    def hopeless(self, costs: BucketCosts, allowed: list[int], rows: list[str]) -> set[int]:
        """The timed widths of those `allowed` (the current one aside) that commit tokens at less than
        HOPELESS of the speed of the best of them."""
        expected = self.expected_tokens(rows=rows)
        speed = {w: expected[w - 1] / costs.ratio[w] for w in allowed if w in costs.ratio and costs.timings(w)}
        best = max(speed.values(), default=0.0)
        return {w for w, s in speed.items() if s < HOPELESS * best and w != costs.current}

    def retime(self, costs: BucketCosts, allowed: list[int], best: int, expected: np.ndarray) -> int:
        """After a step of the best width: another width whose time since it last ran, times its
        share of EXPLORE_SHARE, covers what a run of its steps is expected to lose against the best
        committing as many tokens (the longest waiting of those), else the best again."""
        share = EXPLORE_SHARE / (len(allowed) - 1)
        loss = {w: costs.ratio[w] - expected[w - 1] / expected[best - 1] for w in allowed}  # of a step
        due = [w for w in allowed if costs.since[w] * share >= costs.seconds * loss[w] * self.run_length]
        # and a close rival whose time is the start's alone
        due += [w for w in costs.started.intersection(allowed) if loss[w] <= VERIFY_LOSS]
        return max(due, key=costs.since.__getitem__, default=best)

    def observe(
        self,
        batch: int,
        width: int,
        seconds: float | None,
        offered: list[int],
        accepted: list[int],
        beside: tuple[int | None, ...] = (),
        rows: list[str] = (),
        confidence: list[np.ndarray | None] = (),
        chances: list[np.ndarray | None] = (),
    ) -> None:
        """One step: its batch, the width class it ran and its wall time (None: not a timing of
        that width), per sequence the drafts offered and accepted, `beside`: the width classes
        of the steps whose host work fell in its time (committed, launched; None: none), the
        sequences' request ids `rows` (none: the counts of all sequences only), where the drafter
        predicts them each one's confidences of its drafts, and where the step reports them each
        one's chances of acceptance of its drafts reached (None: none; `step.Verdict.chances`),
        which count as those drafts' acceptances: a sampled draft's chance is the expected value
        of its 0/1 outcome, without the outcome's noise."""
        self.width_steps[width] += 1
        if is_timing(width, seconds, beside):
            self.bucket(batch).record(width, seconds)
        if not any(offered):  # a plain step: it tells nothing, and the rates age by drafts seen
            return
        seen = drafts_seen(offered, accepted, self.counts.counts.shape[-1])
        seen = with_chances(seen, chances)
        self.counts.add(seen.sum(0))
        self.estimates = None
        drafted = [i for i, n in enumerate(offered[: len(rows)]) if n]
        if drafted:
            slots = self.slot_rows([rows[i] for i in drafted])  # first: it may grow `own`
            self.own.add_rows(seen[drafted] if len(drafted) < len(seen) else seen, slots)
        given = [i for i, c in enumerate(confidence) if c is not None and len(c)]
        if given:
            self.observe_confidence(seen, rows, confidence, given)

    def observe_confidence(
        self, seen: np.ndarray, rows: list[str], confidence: list[np.ndarray | None], given: list[int]
    ) -> None:
        """A step's confidences (of the sequences `given`): each one's as its latest, and those of the
        drafts reached (`seen` [sequences, 2, positions]) beside their acceptances for the calibration."""
        latest = np.full(seen.shape[::2], np.nan)
        for i in given:
            latest[i, : len(confidence[i])] = confidence[i]
        reached = (seen[:, 0] > 0) & ~np.isnan(latest)
        self.calibration.add(
            np.stack([np.where(reached, latest, 0.0).sum(0), np.where(reached, seen[:, 1], 0.0).sum(0)])
        )
        for i in given:
            if i < len(rows):
                self.confidence[rows[i]] = latest[i]

    def slot_rows(self, rows: list[str]) -> list[int]:
        """The rows of `own` of the sequences `rows`, a zeroed one for each new to it."""
        for row in rows:
            if row not in self.slots:
                slot = self.free.pop() if self.free else len(self.slots)
                if slot == len(self.own.counts):  # full: twice the rows
                    grown = AcceptCounts.zeros(max(2 * slot, 8), self.own.counts.shape[-1])
                    grown.counts[:slot] = self.own.counts
                    self.own = grown
                self.own.counts[slot] = 0.0
                self.slots[row] = slot
        return [self.slots[row] for row in rows]

    def forget(self, row: str) -> None:
        """A sequence has finished: its row of counts is free."""
        self.confidence.pop(row, None)
        if (slot := self.slots.pop(row, None)) is not None:
            self.free.append(slot)
