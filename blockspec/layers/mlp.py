"""The SwiGLU MLP: gate and up in one packed projection (`gate_up_proj`), then down."""

import torch
from torch import nn

from blockspec.layers.linear import Linear
from blockspec.layers.norm import RMSNorm, fold_norm_weight


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)  # gate|up: one GEMM
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, norm: RMSNorm | None, residual: bool = True) -> torch.Tensor:
        """x + mlp(norm(x)) (without `residual`: mlp(norm(x))): the norm and SwiGLU run in the gate|up
        GEMM, the add in the down GEMM."""
        return self.down_proj(self.gate_up_proj(x, norm=norm, swiglu=True), residual=x if residual else None)

    def fold_norm(self, norm: RMSNorm) -> None:
        fold_norm_weight(norm, self.gate_up_proj)
