"""SwiGLU activation of a packed gate|up projection."""

import torch
import torch.nn.functional as F

from blockspec.layers.fast_path import cuda_compiled
from blockspec.layers.row_invariant import elementwise


@cuda_compiled
def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return elementwise(F.silu, gate) * up
