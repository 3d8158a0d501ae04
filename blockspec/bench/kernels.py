"""Where a step's device time goes, kernel by kernel: `torch.profiler` over a few engine steps, each
kernel's (CUDA) or op's (CPU, self time) total divided by the steps. Kernels inside CUDA graph
replays are recorded as the graph runs them; launches are not (a replay launches them all). A
kernel launched with programmatic dependent launch (Hopper+, `KernelConfig.pdl`) starts before the
kernel ahead of it ends and waits for it, its time counting the wait: there the kernels' times sum
past the step time, and `BLOCKSPEC_PDL=0` gives kernels' own times."""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.autograd.profiler_util import FunctionEventAvg
from torch.profiler import ProfilerActivity, profile

TOP_KERNELS = 12  # rows kept per measurement; the rest is summed as OTHER
OTHER = "(other)"


@dataclass
class KernelTime:
    ms_per_step: float
    calls_per_step: float


def device_time_us(event: FunctionEventAvg, cuda: bool) -> float:
    """An averaged profiler event's own time on the device the bench runs on (µs over all steps)."""
    if cuda:
        return event.device_time_total if event.device_type.name == "CUDA" else 0.0
    return event.self_cpu_time_total


def kernel_times(run_step: Callable[[], None], steps: int, cuda: bool) -> dict[str, KernelTime]:
    """Device time per step of each kernel that `steps` calls of `run_step` run, the TOP_KERNELS
    largest by name (longest first), the others summed under OTHER."""
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        for _ in range(steps):
            run_step()
        if cuda:
            torch.cuda.synchronize()
    timed = [(device_time_us(e, cuda), e.count, e.key) for e in prof.key_averages()]
    timed = sorted((t for t in timed if t[0] > 0), reverse=True)
    kept = {key: KernelTime(us / 1e3 / steps, count / steps) for us, count, key in timed[:TOP_KERNELS]}
    rest = timed[TOP_KERNELS:]
    if rest:
        kept[OTHER] = KernelTime(sum(t[0] for t in rest) / 1e3 / steps, sum(t[1] for t in rest) / steps)
    return kept
