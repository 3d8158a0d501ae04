"""Programmatic dependent launch (Hopper+). A kernel launched with it may start while the kernel
before it is still running: at its top it lets the next kernel launch, then waits
(griddepcontrol.wait) until the previous kernel is done and its writes are visible. All its reads
and writes come after the wait, so it neither reads unfinished outputs nor overwrites memory the
previous kernel still reads; what it hides is part of the gap at each kernel boundary.

Only the skinny GEMV launches with it, where it was measured to pay (H200, 36 layers of the four
fused GEMMs at one row: 3,868 -> 3,770 µs); the MMA kernel at 16 rows lost by it (3,957 ->
4,809 µs). Nor did it pay spread over the other hot kernels (MMA, rope, attention, combine,
quantize_rows) with the next kernel let in after the main loop instead of at the top (H200, bench
--simulate-tau 6.5: DFlash 5.68 -> 5.58 ms a step at batch 1, 10.55 -> 10.73 at batch 16; at the
top, slower at both). On the MMA kernel alone, with the next kernel let in after the K loop,
the 36-layer chain gained 1.5% but a DFlash step at batch 1 nothing, and prefetching the first
weight lines to L2 before the wait made the chain slower (README, Measured). BLOCKSPEC_PDL=0
launches plainly (for A/B runs)."""

import functools
import os

import torch
import triton
import triton.language as tl

from blockspec.layers.kernels import is_hopper_or_later

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older triton: no grid dependency control, kernels launch plainly
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def await_previous_kernel(PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


def pdl_launch(device: torch.device) -> dict:
    """A PDL kernel's launch arguments on `device`: its PDL flag, and the launch option where it
    is on (CUDA sm_90+, a triton that has it, not the interpreter)."""
    on = device.type == "cuda" and _supported(device.index)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@functools.cache
def _supported(index: int) -> bool:
    return (
        gdc_wait is not None
        and os.environ.get("BLOCKSPEC_PDL", "1") != "0"
        and os.environ.get("TRITON_INTERPRET", "0") != "1"
        and is_hopper_or_later(index)
    )
