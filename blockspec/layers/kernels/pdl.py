"""Programmatic dependent launch (Hopper+). A kernel launched with it may start while the kernel
before it is still running, once that kernel lets it in (griddepcontrol.launch_dependents); it
then waits (griddepcontrol.wait) until the previous kernel is done and its writes are visible.
All its reads and writes come after the wait, so it neither reads unfinished outputs nor
overwrites memory the previous kernel still reads; what it hides is part of the gap at each kernel
boundary.

Two forms. The one-row GEMV lets the next kernel in at its top (`await_previous_kernel`; H200,
36 layers of the four fused GEMMs at one row: 3,868 -> 3,770 µs). The kernels of a step above one
row (the 16-row MMA GEMM, its split-K reduce, the fused attention and its combine, quantize_rows)
wait at their top (`wait_previous_kernel`) and let the next kernel in after their main loop
(`let_next_kernel_in`), so that its launch overlaps their last loads and epilogue; the small
reduce, combine and quantize kernels let it in at their top. H200, `bench --simulate-tau 6.5`, an
A/B in one call against main (session 18): DFlash B=1 5.20/5.21 -> 5.12/5.12 ms, B=16
10.22/10.18 -> 10.13/10.10, plain B=16 4.73 -> 4.64. The GEMM letting the next kernel in at its
top lost, before its wait (36-layer chain 3,957 -> 4,809 µs) and after it (with the attention
too: DFlash B=1 5.06 -> 6.17 ms); so did prefetching the first weight lines to L2 before the wait
(README, Measured); an earlier try over the hot kernels, before rope and the K/V write fused into
the attention, gained at B=1 and lost at B=16 (10.55 -> 10.73 ms).
BLOCKSPEC_PDL=0 launches plainly (for A/B runs)."""

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
def wait_previous_kernel(PDL: tl.constexpr):
    if PDL:
        gdc_wait()


@triton.jit
def let_next_kernel_in(PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()


@triton.jit
def await_previous_kernel(PDL: tl.constexpr):
    """At a kernel's top: let the next kernel in, then wait for the previous one."""
    let_next_kernel_in(PDL)
    wait_previous_kernel(PDL)


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
