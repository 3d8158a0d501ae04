"""Linear layers whose few-row CUDA inference (decode, verify and propose steps) runs the Triton
skinny GEMM (`blockspec.layers.kernels.skinny_linear`), which reads the weight faster than cuBLAS
at those shapes and fuses the decoder layer's small ops into it: the RMSNorm or SwiGLU before the
GEMM and the residual add after it. Everything else (CPU, training, prefill) runs the ops one by
one, the reference that the kernel is tested against (without a bias, the residual add is the
GEMM's own: addmm).
BLOCKSPEC_TRITON_LINEAR=0 keeps the unfused ops and cuBLAS everywhere (for A/B runs)."""

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.layers.activation import silu_mul
from blockspec.layers.fast_path import fast_path
from blockspec.layers.kernels import kernel_module
from blockspec.layers.norm import RMSNorm

# Rows up to which the kernel reads bf16/fp16 weights faster than cuBLAS (H200, measured at 1 and 16).
LINEAR_MAX_M = 16


@functools.cache
def _kernel_on() -> bool:
    return os.environ.get("BLOCKSPEC_TRITON_LINEAR", "1") != "0" and kernel_module("skinny_linear") is not None


def prologue(x: torch.Tensor, norm: RMSNorm | None, gated: bool) -> torch.Tensor:
    """The GEMM's input: norm(x), or SiLU(gate) * up of x = gate|up with `gated`, or x."""
    if norm is not None and gated:
        raise ValueError("a linear has one prologue: norm or gated, not both")
    if norm is not None:
        x = norm(x)
    return silu_mul(x) if gated else x


def dense(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None
) -> torch.Tensor:
    """residual + F.linear(x, weight, bias); without a bias the add is cuBLAS's epilogue (addmm)."""
    if residual is None or bias is not None:
        y = F.linear(x, weight, bias)
        return y if residual is None else residual + y
    flat = torch.addmm(residual.reshape(-1, weight.shape[0]), x.reshape(-1, x.shape[-1]), weight.t())
    return flat.view(residual.shape)


def fused_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    norm: RMSNorm | None,
    gated: bool,
    residual: torch.Tensor | None,
) -> torch.Tensor:
    """The skinny kernel (triton needed; at most LINEAR_MAX_M rows, as `linear` sends them) with
    the residual add fused in, and the prologue where it was measured to pay (H200): always at one
    row (the GEMV); past one row, the MMA kernel takes the RMSNorm on its weight tile (its register
    operand; q|k|v at 16 rows 17.0 µs against 17.9 apart), while SwiGLU runs apart: computed in
    registers, it would be stored back to shared memory as the MMA's operand, which stalls the
    weight stream (down_proj at 4 and 16 rows: 58-59 µs fused against 31-32 apart). SwiGLU as
    gate|up's epilogue instead (gate and up rows accumulated side by side) was slower at both row
    counts: a plain decode step 4.45 -> 5.10 ms, a DFlash step 5.72 -> 5.99 (bench, batch 1)."""
    if gated and x.numel() > x.shape[-1]:
        x, norm, gated = prologue(x, norm, gated), None, False
    norm_args = None if norm is None else (norm.weight, norm.eps)
    return kernel_module("skinny_linear").skinny_linear(x, weight, bias, None, norm_args, gated, residual)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    norm: RMSNorm | None = None,
    gated: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """residual + F.linear(prologue(x, norm, gated), weight, bias) (residual None: no add); on CUDA,
    without grad, for bf16/fp16 and at most LINEAR_MAX_M rows, the skinny kernel (`fused_linear`)."""
    if (
        fast_path(x)
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and x.numel() <= LINEAR_MAX_M * x.shape[-1]
        and _kernel_on()
    ):
        return fused_linear(x, weight, bias, norm, gated, residual)
    return dense(prologue(x, norm, gated), weight, bias, residual)


class Linear(nn.Linear):
    """nn.Linear (same parameters and state dict) computed by `linear`, with its optional
    prologue (`norm`, `gated`) and residual add."""

    def forward(
        self,
        x: torch.Tensor,
        norm: RMSNorm | None = None,
        gated: bool = False,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return linear(x, self.weight, self.bias, norm, gated, residual)
