"""Linear layers whose few-row CUDA inference (decode, verify and propose steps) runs the Triton
skinny GEMM (`blockspec.layers.kernels.skinny_linear`), which reads the weight faster than cuBLAS
at those shapes; everything else (CPU, training, prefill) runs `F.linear`, the reference that the
kernel is tested against. BLOCKSPEC_TRITON_LINEAR=0 keeps cuBLAS everywhere (for A/B runs)."""

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.layers.fast_path import fast_path

# Rows up to which the kernel reads bf16/fp16 weights faster than cuBLAS (H200, measured at 1 and 16).
LINEAR_MAX_M = 16


@functools.cache
def skinny_kernels():
    """The Triton module `blockspec.layers.kernels.skinny_linear`, or None without triton."""
    try:
        from blockspec.layers.kernels import skinny_linear
    except ImportError:  # no triton (CPU installs, CI)
        return None
    return skinny_linear


@functools.cache
def _kernel_on() -> bool:
    return os.environ.get("BLOCKSPEC_TRITON_LINEAR", "1") != "0" and skinny_kernels() is not None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias); on CUDA, without grad, for bf16/fp16 and at most LINEAR_MAX_M
    rows, computed by the skinny kernel."""
    if (
        fast_path(x)
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and x.numel() <= LINEAR_MAX_M * x.shape[-1]
        and _kernel_on()
    ):
        return skinny_kernels().skinny_linear(x, weight, None, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters and state dict) computed by `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
