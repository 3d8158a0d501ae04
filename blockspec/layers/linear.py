"""Linear layers whose few-row CUDA inference (decode, verify and propose steps) runs the Triton
skinny GEMM (`blockspec.layers.kernels.skinny_linear`), which reads the weight faster than cuBLAS
at those shapes and fuses the decoder layer's small ops into it: the RMSNorm before the GEMM, and
SwiGLU (of a gate|up projection) or the residual add after it. Everything else (CPU, training,
prefill) runs the ops one by one (`dense`), the reference that the kernel is tested against
(without a bias, the residual add is the GEMM's own: addmm).
`KernelConfig.triton_linear` off keeps the unfused ops and cuBLAS everywhere (for A/B runs), and
loading then leaves the norm weights in the norms (`loading.finish.target_options`)."""

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.layers.activation import silu_mul
from blockspec.layers.cpu_gemm import measure_min_rows, pack, packed_linear, takes_packed
from blockspec.layers.fast_path import active_kernels, fast_path
from blockspec.layers.kernels import kernel_module, num_sms
from blockspec.layers.norm import RMSNorm
from blockspec.layers.row_invariant import row_invariant, tiled_linear

# Rows up to which the kernel reads bf16/fp16 weights faster than cuBLAS; and for weights of at
# most SMALL_WEIGHT elements (a small model's layers: latency-bound, where the kernel's fused norm,
# SwiGLU and residual add save more than cuBLAS's tiles gain), up to SMALL_LINEAR_MAX_M rows.
LINEAR_MAX_M = 16
SMALL_LINEAR_MAX_M = 64
SMALL_WEIGHT = 1 << 21


def _skinny_on() -> bool:
    return active_kernels().triton_linear and kernel_module("skinny_linear") is not None


def fused_gemms_on(device: torch.device) -> bool:
    """Whether `linear` sends few-row calls on `device` to the skinny kernel (CUDA, triton, not
    switched off)."""
    return device.type == "cuda" and _skinny_on()


def dense(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    norm: RMSNorm | None = None,
    swiglu: bool = False,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """The unfused ops: residual + F.linear(norm(x), weight, bias) (`gemm`), then SiLU(gate) * up of
    the gate|up output with `swiglu`."""
    assert not (swiglu and residual is not None), "SwiGLU's output takes no residual"
    y = gemm(x if norm is None else norm(x), weight, bias, residual, packed)
    return silu_mul(y) if swiglu else y


def gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """residual + F.linear(x, weight, bias): on the CPU in one call on the weight's packed copy where
    it pays or keeps a row's bits (`cpu_gemm.takes_packed`); else under row invariance in fixed
    tiles of rows (`row_invariant.tiled_linear`); else without a bias the residual add is the GEMM's
    epilogue (addmm)."""
    if takes_packed(x, packed):
        y = packed_linear(x, packed, bias)
    elif row_invariant():
        y = tiled_linear(x, weight, bias, packed)
    elif residual is not None and bias is None:
        flat = torch.addmm(residual.reshape(-1, weight.shape[0]), x.reshape(-1, x.shape[-1]), weight.t())
        return flat.view(residual.shape)
    else:
        y = F.linear(x, weight, bias)
    return y if residual is None else residual + y


def fused_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    norm: RMSNorm | None,
    swiglu: bool,
    residual: torch.Tensor | None,
) -> torch.Tensor:
    """The skinny kernel (triton needed; at most `skinny_max_rows` rows, as `linear` sends them) with
    the RMSNorm as its prologue (at one row on x, past it on the MMA kernel's weight tile, its
    register operand; only 1 / rms where the norm's weight is folded into the GEMM's,
    `CausalLM.fold_norms`), and SwiGLU or the residual add as its epilogue (as a prologue of
    down_proj above one row, the computed MMA operand stalls the weight stream)."""
    norm_args = None if norm is None else (norm.weight, norm.eps)
    return kernel_module("skinny_linear").skinny_linear(x, weight, bias, None, norm_args, swiglu, residual)


def invariant_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    norm: RMSNorm | None,
    swiglu: bool,
    residual: torch.Tensor | None,
) -> torch.Tensor:
    """`fused_linear` under row invariance, at any number of rows: the MMA kernel with the weight's
    fixed split of K (`skinny_linear.invariant_config`), so each output's sum runs over K in one
    order whatever the row count; the norm apart, by a kernel of one program a row (the prologue's
    sum of squares would follow the tile)."""
    x = x if norm is None else norm(x)
    module = kernel_module("skinny_linear")
    M, N, K = x.numel() // x.shape[-1], weight.shape[0], x.shape[-1]
    config = module.invariant_config(M, N, K, num_sms(x.device, interpreted=8))
    return module.skinny_linear(x, weight, bias, config, None, swiglu, residual)


def skinny_max_rows(weight: torch.Tensor) -> int:
    """Rows up to which `linear` runs the skinny kernel on `weight`."""
    return SMALL_LINEAR_MAX_M if weight.numel() <= SMALL_WEIGHT else LINEAR_MAX_M


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    norm: RMSNorm | None = None,
    swiglu: bool = False,
    residual: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """`dense`: residual + F.linear(norm(x), weight, bias), or SiLU(gate) * up of it with `swiglu`
    (residual None: no add); on CUDA, without grad, for bf16/fp16, the skinny kernel: at most
    `skinny_max_rows` rows (`fused_linear`), or any number under row invariance (`invariant_linear`).
    `packed`: the weight's packed copy for the CPU (`cpu_gemm.pack`)."""
    if fast_path(x) and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype and _skinny_on():
        if row_invariant():
            return invariant_linear(x, weight, bias, norm, swiglu, residual)
        if x.numel() <= skinny_max_rows(weight) * x.shape[-1]:
            return fused_linear(x, weight, bias, norm, swiglu, residual)
    return dense(x, weight, bias, residual, norm, swiglu, packed)


def pack_linears(model: nn.Module, dtype: torch.dtype | None = None) -> None:
    """Give every `Linear` of `model` its weight's packed copy for the CPU (`cpu_gemm.pack`), in
    `dtype` (None: the weight's), and the first time a model is large enough, measure from how many
    rows the fp32 copies serve (`cpu_gemm.measure_min_rows`)."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    for module in linears:
        module.packed = pack(module.weight, dtype)
    copies = [(m.weight, m.packed) for m in linears if m.packed is not None]
    measure_min_rows([(w, p) for w, p in copies if w.dtype == p.dtype == torch.float32])


class Linear(nn.Linear):
    """nn.Linear (same parameters and state dict) computed by `linear`, with its optional norm
    prologue, SwiGLU epilogue (a gate|up projection) and residual add; on the CPU its weight's
    packed copy, where loading made one (`pack_linears`), serves its GEMMs."""

    packed: torch.Tensor | None = None

    def forward(
        self,
        x: torch.Tensor,
        norm: RMSNorm | None = None,
        swiglu: bool = False,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return linear(x, self.weight, self.bias, norm, swiglu, residual, self.packed)
