"""SwiGLU activation of a packed gate|up projection."""

import torch
import torch.nn.functional as F

from blockspec.layers.fast_path import fast_kernels
from blockspec.layers.row_invariant import elementwise


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return elementwise(F.silu, gate) * up


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu_mul_ref`; on CUDA one Triton kernel (`blockspec.layers.kernels.swiglu`)."""
    kernels = fast_kernels(gate_up, "swiglu")
    return silu_mul_ref(gate_up) if kernels is None else kernels.swiglu_rows(gate_up)
