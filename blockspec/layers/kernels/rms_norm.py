"""RMSNorm in Triton, one program a row over all its features: the CUDA implementation of
`blockspec.layers.norm.rms_norm_ref` wherever no GEMM takes the norm in as its prologue. A row's
sum runs in one order at any row count, as row invariance (`blockspec.layers.row_invariant`)
needs (torch.compile's reduction picks its tiling, and with it the order of a row's sum, by the
number of rows), and it is one launch from Python (an eager prefill calls it twice a layer).
Computed in fp32, the normed row rounded to the activation dtype before the weight multiplies
it, as the reference does."""

import torch
import triton
import triton.language as tl

from blockspec.layers.kernels.pdl import await_previous_kernel, pdl_launch

NUM_WARPS = 8  # fixed: the threads that share a row's sum, and so its order, never change


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, H, eps, HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    await_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(x_ptr + row * H + offs, mask=mask, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x) / H + eps)
    y = (x * r).to(y_ptr.dtype.element_ty)
    if HAS_WEIGHT:
        y = (tl.load(w_ptr + offs, mask=mask).to(tl.float32) * y.to(tl.float32)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * H + offs, y, mask=mask)


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """weight * (x / rms(x)) per row of x [..., H] (weight [H] in x's dtype, or None) -> x's shape
    and dtype. Rows are made contiguous, so that the kernel's arguments are the width alone (Triton
    specializes a stride by its divisibility: a caller's view would compile a variant while serving)."""
    # the reference's product promotes to the wider dtype: a weight wider than x would widen y
    assert weight is None or torch.promote_types(weight.dtype, x.dtype) == x.dtype, (weight.dtype, x.dtype)
    H = x.shape[-1]
    x2 = x.reshape(-1, H).contiguous()
    y = torch.empty((x2.shape[0], H), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, x2 if weight is None else weight, y, H, eps,
            HAS_WEIGHT=weight is not None, BLOCK=triton.next_power_of_2(H), num_warps=NUM_WARPS,
            **pdl_launch(x.device),
        )  # fmt: skip
    return y.view(x.shape)
