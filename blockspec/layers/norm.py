"""RMSNorm, computed in float32 as Hugging Face does so that fp32/bf16 results match it."""

import torch
from torch import nn

from blockspec.layers.fast_path import cuda_compiled


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm_ref(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, its RMSNorm): the residual add and the norm that follows it, one kernel on the
    GPU. Compiled, the norm may read the sum before its rounding to x's dtype (bf16: within an ulp
    of the eager result)."""
    x = x + delta
    return x, rms_norm_ref(x, weight, eps)


rms_norm = cuda_compiled(rms_norm_ref)
add_rms_norm = cuda_compiled(add_rms_norm_ref)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, its norm), fused; delta None: (x, its norm)."""
        return (x, self(x)) if delta is None else add_rms_norm(x, delta, self.weight, self.eps)
