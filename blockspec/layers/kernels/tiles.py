"""Triton helpers shared by the kernels that read a decoder layer's activations: a tile load that
skips its mask on even shapes, and the SwiGLU prologue of a gate|up tile."""

import triton
import triton.language as tl


@triton.jit
def load_tile(ptrs, mask, EVEN: tl.constexpr):
    if EVEN:
        v = tl.load(ptrs)
    else:
        v = tl.load(ptrs, mask=mask, other=0.0)
    return v


@triton.jit
def swiglu_tile(x_ptrs, up_offset, mask, EVEN: tl.constexpr):
    """SiLU(gate) * up of a gate|up tile, computed in float32 and rounded to x's dtype (as the
    unfused op stores it)."""
    gate = load_tile(x_ptrs, mask, EVEN).to(tl.float32)
    up = load_tile(x_ptrs + up_offset, mask, EVEN).to(tl.float32)
    return (gate * tl.sigmoid(gate) * up).to(x_ptrs.dtype.element_ty)
