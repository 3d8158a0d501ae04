"""CPU linears on weights packed once, at load, into oneDNN's blocked layout. `F.linear` on the
CPU lays its weight out anew on every call (MKL's fp32 GEMM packs it above two rows; oneDNN's bf16
GEMM reorders it into AMX tiles), and for the few rows of a decode, verify or propose step that
copy is a large part of the GEMM's time. Packed once, it is not made again. fp32 at one or two rows
stays with `F.linear`, whose GEMV-like path reads the weight faster than the packed GEMM there
(`MIN_ROWS`).

The packed copy sits beside the weight (a `Linear`'s `packed`), made last at load
(`loading.finish`): nothing changes the weight afterwards. It costs one more copy of each linear's
weight in memory. `KernelConfig.cpu_packed` off makes no copies at load and leaves any made
unused; so does row invariance, whose fixed tiles of rows oneDNN's GEMM would not keep. A float32
engine's drafter may hold bfloat16 copies (`SpeculativeConfig.cpu_bf16`): its float32 rows are
rounded to bf16 on the way in and its outputs come back in float32."""

import torch

from blockspec.layers.fast_path import active_kernels

# Rows from which the packed GEMM beats F.linear, per dtype (fp32: MKL's path at 1-2 rows is faster)
MIN_ROWS = {torch.float32: 3, torch.bfloat16: 1}


def packing_supported(device: torch.device) -> bool:
    """The CPU with torch's oneDNN, the switch on, and no row invariance (its fixed tiles of rows
    would leave the copies unused)."""
    kernels = active_kernels()
    return (
        device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and kernels.cpu_packed
        and not kernels.row_invariant
    )


def bf16_supported() -> bool:
    """oneDNN runs bf16 GEMMs here (and packs their weights): natively, or emulated on AVX-512."""
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


def native_cpu_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX): there bf16 GEMMs are faster
    than fp32."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def pack(weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """oneDNN's packed copy of a [N, K] weight, in `dtype` (None: the weight's); None for a dtype it
    is not used for, or bf16 on a CPU without bf16 instructions (oneDNN refuses to pack it there)."""
    dtype = dtype or weight.dtype
    if dtype not in MIN_ROWS or (dtype == torch.bfloat16 and not bf16_supported()):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype))


def takes_packed(x: torch.Tensor, packed: torch.Tensor | None) -> bool:
    """Whether a linear of x runs on its weight's packed copy: on the CPU, without grad, the switch
    on and row invariance off, x in the copy's dtype (or float32 for a bf16 copy), from the copy
    dtype's MIN_ROWS."""
    kernels = active_kernels()
    return (
        packed is not None
        and x.device.type == "cpu"
        and (x.dtype == packed.dtype or (x.dtype == torch.float32 and packed.dtype == torch.bfloat16))
        and not torch.is_grad_enabled()
        and kernels.cpu_packed
        and not kernels.row_invariant
        and x.numel() >= MIN_ROWS[packed.dtype] * x.shape[-1]
    )


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) on the weight's packed copy (`pack`), in the copy's dtype; the
    result in x's."""
    rows = x.reshape(-1, x.shape[-1]).to(packed.dtype)
    bias = bias.to(packed.dtype) if bias is not None else None
    y = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return y.view(*x.shape[:-1], y.shape[-1]).to(x.dtype)
