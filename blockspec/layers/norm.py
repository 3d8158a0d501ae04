"""RMSNorm, computed in float32 as Hugging Face does so that fp32/bf16 results match it."""

import torch
from torch import nn

from blockspec.layers.fast_path import fast_kernels


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x.to(dtype) if weight is None else weight * x.to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`rms_norm_ref`; on CUDA the Triton kernel of one program a row
    (`blockspec.layers.kernels.rms_norm`): a row's sum in one order at any row count (row
    invariance), and one launch from Python, where a compiled function's dispatch costs several
    (an eager prefill calls it twice a layer)."""
    kernels = fast_kernels(x, "rms_norm")
    return rms_norm_ref(x, weight, eps) if kernels is None else kernels.rms_norm_rows(x, weight, eps)


class RMSNorm(nn.Module):
    """weight None: folded into the linear that reads the output (`fold_norm_weight`)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


@torch.no_grad()
def fold_norm_weight(norm: RMSNorm, linear: nn.Linear) -> None:
    """Move the norm's weight g into the linear that reads its output, W' = W * g per input
    feature (the product in float32, rounded once: what the skinny MMA kernel computes on its
    weight tile at every call), and leave the norm without one. The same function up to that
    rounding, and the GEMMs that fuse the norm then only compute 1 / rms. Once only: a norm
    without a weight is left as it is."""
    if norm.weight is None:
        return
    w = linear.weight
    w.copy_((w.float() * norm.weight.float()).to(w.dtype))
    norm.weight = None
