"""Row-wise E4M3 quantization of activations, with the GEMM's prologue fused in: the input of
`blockspec.layers.quantization.Fp8Linear`'s GEMMs on FP8 tensor cores (the Triton skinny kernel or
`torch._scaled_mm`, each with one scale per row of x and per row of w).

One program per row, two passes over it: the first finds the row's largest magnitude (and, with
an RMSNorm prologue, its sum of squares), the second writes h / scale rounded to E4M3, where h is
the prologue's output, normed (x * w / rms) or x itself, and scale = max |h| / 448. The second
pass reads the row again from L2. The normed row is never stored, so a decoder layer's norm
costs no launch and no round trip of its own. It launches with programmatic dependent launch
(`blockspec.layers.kernels.pdl`)."""

import torch
import triton
import triton.language as tl

from blockspec.layers.kernels.pdl import await_previous_kernel, pdl_launch

FP8_MAX = tl.constexpr(448.0)  # largest E4M3 (fn) value
MAX_BLOCK = 4096


@triton.jit
def _prologue_tile(x_row, norm_ptr, offs, mask, NORM_WEIGHT: tl.constexpr):
    """(h, x) in float32: the prologue's output before the 1 / rms factor, and the raw x tile."""
    x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    h = x
    if NORM_WEIGHT:
        h = x * tl.load(norm_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return h, x


@triton.jit
def _quantize_rows_kernel(  # K is a compile-time constant: a decoder has few widths
    x_ptr, norm_ptr, q_ptr, scale_ptr, stride_x, eps,
    K: tl.constexpr, NORM: tl.constexpr, NORM_WEIGHT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    await_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    amax = tl.zeros((BLOCK,), tl.float32)
    sq = tl.zeros((BLOCK,), tl.float32)
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        h, x = _prologue_tile(x_row, norm_ptr, offs, offs < K, NORM_WEIGHT)
        amax = tl.maximum(amax, tl.abs(h))
        if NORM:
            sq += x * x
    factor = 1.0
    if NORM:
        factor = tl.rsqrt(tl.sum(sq) / K + eps)
    top = tl.max(amax) * factor
    scale = tl.where(top > 0, top / FP8_MAX, 1.0)
    tl.store(scale_ptr + row, scale)
    factor = factor / scale
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        h, x = _prologue_tile(x_row, norm_ptr, offs, offs < K, NORM_WEIGHT)
        q = tl.clamp(h * factor, -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + row * K + offs, q.to(q_ptr.dtype.element_ty), mask=offs < K)


def quantize_rows(x: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows may be strided) -> (q [M, K] float8_e4m3fn, scale [M, 1] float32) with
    q * scale ~= x, or RMSNorm(x) with `norm` = (weight [K] or None: no weight, eps). All-zero
    rows get scale 1."""
    assert x.dim() == 2 and x.stride(1) == 1, f"rows of contiguous features expected, got {tuple(x.shape)}"
    M, K = x.shape
    norm_weight, eps = norm if norm is not None else (None, 0.0)
    if norm_weight is not None:
        assert norm_weight.shape == (K,), f"norm weight {tuple(norm_weight.shape)} for {K} features"
    q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    if M == 0 or K == 0:
        return q, scale.fill_(1.0)
    block = min(MAX_BLOCK, triton.next_power_of_2(K))
    _quantize_rows_kernel[(M,)](  # an unread pointer gets some tensor
        x, x if norm_weight is None else norm_weight, q, scale, x.stride(0), eps, K=K, NORM=norm is not None,
        NORM_WEIGHT=norm_weight is not None, BLOCK=block,
        num_warps=8 if block >= 2048 else 4, **pdl_launch(x.device),
    )  # fmt: skip
    return q, scale
