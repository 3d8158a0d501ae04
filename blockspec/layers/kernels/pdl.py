"""Programmatic dependent launch (Hopper+). A kernel launched with it may start while the kernel
before it is still running, once that kernel lets it in (griddepcontrol.launch_dependents); it
then waits (griddepcontrol.wait) until the previous kernel is done and its writes are visible.
All its reads and writes come after the wait, so it neither reads unfinished outputs nor
overwrites memory the previous kernel still reads; what it hides is part of the gap at each kernel
boundary.

Two forms. The one-row GEMV lets the next kernel in at its top (`await_previous_kernel`). The
kernels of a step above one row (the 16-row MMA GEMM, its split-K reduce, the fused and the paged
attention and its combine, quantize_rows) wait at their top (`wait_previous_kernel`) and let the
next kernel in after their main loop (`let_next_kernel_in`), so that its launch overlaps their
last loads and epilogue (letting it in at their top, as the GEMV does, is slower for the MMA GEMM);
the small reduce, combine, quantize, RMSNorm and q/k norm + rope kernels let it in at their top.
`KernelConfig.pdl` off launches plainly (for A/B runs)."""

import functools
import os

import torch
import triton
import triton.language as tl

from blockspec.layers.fast_path import active_kernels
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
    is on (switched on, CUDA sm_90+, a triton that has it, not Triton's interpreter)."""
    on = device.type == "cuda" and active_kernels().pdl and _pdl_capable(device.index)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@functools.cache
def _pdl_capable(index: int) -> bool:
    # TRITON_INTERPRET is Triton's own (set before triton is imported), so it is fixed for the process.
    return gdc_wait is not None and os.environ.get("TRITON_INTERPRET", "0") != "1" and is_hopper_or_later(index)
