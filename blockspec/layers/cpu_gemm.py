"""CPU linears on weights packed once, at load, into oneDNN's blocked layout. `F.linear` on the
CPU lays its weight out anew on every call (MKL's fp32 GEMM packs it above two rows; oneDNN's bf16
GEMM reorders it into AMX tiles), and for the few-row GEMMs of decoding that copy costs about what
the GEMM itself does: packed once, a verify's rows cost little more than a decode row's, and bf16
linears run faster at every row count. fp32 at one or two rows stays with `F.linear`, whose
GEMV-like path reads the weight faster than the packed GEMM (`MIN_ROWS`).

The packed copy sits beside the weight (a `Linear`'s `packed`): one more copy of each linear's
weight in memory. `KernelConfig.cpu_packed` off packs nothing (`F.linear` everywhere)."""

import torch
from torch import nn

from blockspec.layers.fast_path import active_kernels

# Rows from which the packed GEMM beats F.linear, per dtype (fp32: MKL's path at 1-2 rows is faster)
MIN_ROWS = {torch.float32: 3, torch.bfloat16: 1}


def packing_supported(device: torch.device) -> bool:
    """The CPU with torch's oneDNN, and the switch on."""
    return device.type == "cpu" and torch.backends.mkldnn.is_available() and active_kernels().cpu_packed


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed copy of a [N, K] weight, or None for a dtype it is not used for."""
    if weight.dtype not in MIN_ROWS:
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def pack_linears(model: nn.Module, linear_type: type[nn.Linear]) -> None:
    """Give every `linear_type` module of `model` its packed weight (`packed`)."""
    for module in model.modules():
        if isinstance(module, linear_type):
            module.packed = pack(module.weight)


def takes_packed(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None) -> bool:
    """Whether a linear of x on `weight` runs on its packed copy: on the CPU, without grad, in the
    weight's dtype, from the dtype's MIN_ROWS."""
    return (
        packed is not None
        and x.device.type == "cpu"
        and x.dtype == weight.dtype
        and not torch.is_grad_enabled()
        and x.numel() >= MIN_ROWS[x.dtype] * x.shape[-1]
    )


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) on the weight's packed copy (`pack`)."""
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
    return y.view(*x.shape[:-1], y.shape[-1])
