"""Fusion of small elementwise functions on the GPU. A decode step is hundreds of tiny
kernels; torch.compile fuses each of these functions into one. The CPU, and training (grad
mode would recompile each function for every switch between the frozen target and the
drafter), run the same function eagerly, so all paths share one definition."""

from collections.abc import Callable

import torch


def cuda_compiled(fn: Callable) -> Callable:
    compiled = torch.compile(fn, dynamic=True)

    def dispatch(x: torch.Tensor, *args):
        return compiled(x, *args) if x.is_cuda and not torch.is_grad_enabled() else fn(x, *args)

    dispatch.__doc__, dispatch.__name__ = fn.__doc__, fn.__name__
    dispatch.eager, dispatch.compiled = fn, compiled  # the fused kernel is tested against the reference
    return dispatch
