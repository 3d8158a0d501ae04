"""SwiGLU of a packed gate|up row in Triton: the CUDA implementation of
`blockspec.layers.activation.silu_mul_ref`. One launch from Python, where a compiled function's
dispatch (its guards and wrappers) costs several Triton launches: an eager prefill calls it once a
layer. SiLU in float32, rounded to the activation dtype before the product, as the reference rounds
F.silu's output; elementwise, so a row's result never depends on the rows beside it."""

import torch
import triton
import triton.language as tl

BLOCK = 1024  # features a program


@triton.jit
def _swiglu_kernel(x_ptr, y_ptr, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(x_ptr + row * 2 * N + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * N + N + cols, mask=mask, other=0.0)
    silu = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    tl.store(y_ptr + row * N + cols, (silu.to(tl.float32) * up.to(tl.float32)).to(up.dtype), mask=mask)


def swiglu_rows(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of gate_up [..., 2N] -> [..., N] in its dtype. Rows are made contiguous, so
    that the kernel's arguments are the width alone (Triton specializes a stride by its
    divisibility: a caller's view would compile a variant while serving)."""
    assert gate_up.shape[-1] % 2 == 0, f"gate|up needs an even width, got {gate_up.shape[-1]}"
    N = gate_up.shape[-1] // 2
    x = gate_up.reshape(-1, 2 * N).contiguous()
    y = torch.empty((x.shape[0], N), dtype=gate_up.dtype, device=gate_up.device)
    if x.shape[0]:
        _swiglu_kernel[(x.shape[0], triton.cdiv(N, BLOCK))](x, y, N, BLOCK=BLOCK)
    return y.view(*gate_up.shape[:-1], N)
