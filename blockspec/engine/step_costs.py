"""Step times measured when the engine starts, for the adaptive width policy to start from.

Without them the policy times each width on live requests first (`adaptive.first_timings`): a
few steps of every width class in every batch bucket, most of them at widths it will not keep.
On a short run (a batch of requests of a few hundred tokens, where rows finish and the batch
falls through its buckets) those steps are a large share of the time, and where plain decoding
wins they lose all of it. Steps here run on warm-up sequences (the trash page) the way the
engine runs them: launched from the previous step's anchors on the device where steps run
ahead, one after another where they do not. They leave out the host's work between steps
(committing tokens, scheduling), so the policy keeps timing widths on live steps too."""

import time
from typing import TYPE_CHECKING

from blockspec.engine.step import finish_step, launch_step
from blockspec.engine.warm_up import KINDS, trash_sequence

if TYPE_CHECKING:
    from blockspec.engine.runner import ModelRunner

TIMED_STEPS = 6  # steps timed at each (bucket, width): they average out a host's jitter


def step_seconds(runner: "ModelRunner", batch: int, width: int, step_rows: int, run_ahead: bool) -> float:
    """Seconds a step of `batch` greedy sequences of `width` rows takes, after one untimed step."""
    columns = -(-step_rows // runner.page_size)
    seqs = [trash_sequence(runner, 0, 0, KINDS[0], columns) for _ in range(batch)]
    widths = [width] * batch
    finish_step(launch_step(runner, seqs, widths, None, None))  # first use; its wait drains the device
    start = time.perf_counter()
    flight = launch_step(runner, seqs, widths, None, None)
    for _ in range(TIMED_STEPS - 1):
        # Positions stay at 0 (the trash page holds whatever they write): only the anchors come
        # from the step before, as the engine's run-ahead takes them.
        ahead = launch_step(runner, seqs, widths, flight.outcome.bonus[:, None], None) if run_ahead else None
        finish_step(flight)
        flight = ahead or launch_step(runner, seqs, widths, None, None)
    finish_step(flight)
    return (time.perf_counter() - start) / TIMED_STEPS


def step_costs(
    runner: "ModelRunner", buckets: list[int], widths: tuple[int, ...], step_rows: int, run_ahead: bool
) -> dict[int, dict[int, float]]:
    """Seconds per step at each batch bucket and width class."""
    return {b: {w: step_seconds(runner, b, w, step_rows, run_ahead) for w in widths} for b in buckets}
