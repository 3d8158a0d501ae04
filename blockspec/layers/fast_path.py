"""The CUDA fast paths and their switch. Inference on a GPU runs Triton kernels (attention, skinny
GEMMs, K/V write, q/k norm + rope) and torch.compile fusions of small elementwise and index functions
(a decode step is hundreds of tiny kernels; each function becomes one or two). Each sits behind the same
function as its reference (eager torch, cuBLAS, gather + SDPA), which the CPU, code with gradients
on (grad mode would recompile each compiled function for every switch between the frozen target
and the drafter in training) and `reference_ops()` run instead, so all paths share one definition."""

import contextlib
from collections.abc import Callable
from types import ModuleType

import torch

from blockspec.layers.kernels import kernel_module

_fast_paths = True


def fast_path(x: torch.Tensor) -> bool:
    """Whether an op on x takes its CUDA fast path: on CUDA, without grad, outside reference_ops."""
    return x.is_cuda and _fast_paths and not torch.is_grad_enabled()


def fast_kernels(x: torch.Tensor, name: str) -> ModuleType | None:
    """The Triton module `blockspec.layers.kernels.<name>` for an op on x that takes its fast path
    (and triton is installed), else None: the op then runs its reference."""
    return kernel_module(name) if fast_path(x) else None


@contextlib.contextmanager
def reference_ops():
    """Run every op's reference even on CUDA (the oracle of the fast-path tests)."""
    global _fast_paths
    _fast_paths, previous = False, _fast_paths
    try:
        yield
    finally:
        _fast_paths = previous


def cuda_compiled(fn: Callable) -> Callable:
    compiled = torch.compile(fn, dynamic=True)

    def dispatch(x: torch.Tensor, *args):
        return compiled(x, *args) if fast_path(x) else fn(x, *args)

    dispatch.__doc__, dispatch.__name__ = fn.__doc__, fn.__name__
    dispatch.eager, dispatch.compiled = fn, compiled  # the fused kernel is tested against the reference
    return dispatch
