"""FP8's CUDA path (W8A8): `quantize_rows` (row-wise E4M3 activations, with the RMSNorm prologue
fused) against the torch reference, and `Fp8Linear` (quantize_rows, then the skinny
kernel up to FP8_SKINNY_MAX_M rows or torch._scaled_mm above) against the same quantized
activations multiplied in float32, also inside a CUDA graph.

CUDA only (Hopper+ for the GEMM): Triton's interpreter rounds float32 to E4M3 wrongly near binade
edges (124.3 -> 64, 17 -> 18 in triton 3.6), so the CPU cannot stand in for it here; the CPU runs
the reference W8A8 path in test_fp8.py."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("triton")

from conftest import CUDA, swiglu_rounded
from test_kernels_linear import check_in_cuda_graph

from blockspec.layers.kernels.quantize_rows import quantize_rows
from blockspec.layers.norm import RMSNorm, rms_norm_ref
from blockspec.layers.quantization import FP8_SKINNY_MAX_M, Fp8Linear, fp8_supported, quantize_weight

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="needs CUDA (see the module docstring)")]
REL_STEP = 2.0**-4  # E4M3 round to nearest: within 2^-4 of the value
SUBNORMAL_HALF_STEP = 2.0**-10  # in units of the row scale


def rows_of_every_kind(M: int, K: int, dtype: torch.dtype, top: int) -> torch.Tensor:
    """Gaussian rows of magnitudes 1e-3..10^top, one row with an outlier, one all-zero row, as a
    strided view (the rows of a wider tensor)."""
    x = torch.randn(M, K + 64, device="cuda") * torch.logspace(-3, top, M, device="cuda")[:, None]
    x[0, 5] = 1e3 * x[0].abs().max()
    x[min(1, M - 1)] = 0.0
    return x.to(dtype)[:, :K]


def kernel_prologue(x: torch.Tensor, norm) -> torch.Tensor:
    """What quantize_rows quantizes, in float32: x * w / rms unrounded, or x."""
    if norm is None:
        return x.float()
    return rms_norm_ref(x.float(), None if norm[0] is None else norm[0].float(), norm[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("M,K", [(1, 96), (37, 4096), (300, 12288)])
@pytest.mark.parametrize("prologue", [None, "norm", "folded"])  # folded: a norm without a weight
def test_quantize_rows_matches_reference(dtype, M, K, prologue):
    torch.manual_seed(M)
    top = 1 if dtype == torch.float16 else 2  # fp16: keep the squares of the rows finite
    x = rows_of_every_kind(M, K, dtype, top)
    norm = (torch.rand(K, device="cuda").add(0.5).to(dtype), 1e-2) if prologue == "norm" else None
    norm = (None, 1e-2) if prologue == "folded" else norm
    q, scale = quantize_rows(x, norm)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (M, K) and scale.shape == (M, 1)
    h = kernel_prologue(x, norm)
    q_ref, scale_ref = quantize_weight(h)
    if prologue is None:  # the same float32 math: the same bytes but for rare ties (x * (1/s) vs x / s)
        assert torch.equal(scale[:, 0], scale_ref)
        assert (q.view(torch.uint8) != q_ref.view(torch.uint8)).sum() <= q.numel() * 1e-4
    else:
        torch.testing.assert_close(scale[:, 0], scale_ref, rtol=1e-5, atol=0)
    # every element within half an E4M3 step of h (relative, or of the row's subnormal spacing),
    # plus float32 noise in the prologue (rare double roundings there)
    deq = q.float() * scale
    bound = (REL_STEP + 2**-7) * h.abs() + SUBNORMAL_HALF_STEP * scale
    assert ((deq - h).abs() <= bound).all(), ((deq - h).abs() / bound).max()
    assert scale[min(1, M - 1)] == 1.0 and q[min(1, M - 1)].float().eq(0).all()  # the zero row


@pytest.mark.skipif(CUDA and not fp8_supported("cuda"), reason="W8A8 needs Hopper+")
@torch.no_grad()
@pytest.mark.parametrize("rows", [16, FP8_SKINNY_MAX_M, FP8_SKINNY_MAX_M + 2, 300])
def test_fp8_linear_w8a8_matches_its_reference(monkeypatch, rows):
    """Fp8Linear on either GEMM, as a decoder layer calls it: q|k|v with the norm, bias and
    residual; gate|up with the norm and SwiGLU on a 3-D input (the drafter's [B, T, ...]); down
    with a 3-D residual. Against the same quantized activations and weight multiplied in float32
    (bf16 rounding of the output apart), and within E4M3 steps of the result with unrounded
    activations."""
    torch.manual_seed(rows)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    qkv = Fp8Linear.from_linear(nn.Linear(4096, 6144, bias=True, device=dev, dtype=dtype))
    gate_up = Fp8Linear.from_linear(nn.Linear(4096, 2 * 12288, bias=True, device=dev, dtype=dtype))
    down = Fp8Linear.from_linear(nn.Linear(12288, 4096, bias=False, device=dev, dtype=dtype))
    norm = RMSNorm(4096, 1e-6).to(dev, dtype)
    norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(rows, 4096, device=dev, dtype=dtype)
    x3 = x.view(2, rows // 2, 4096)
    h3 = torch.randn(2, rows // 2, 12288, device=dev, dtype=dtype)
    res, res3 = (
        torch.randn(rows, 6144, device=dev, dtype=dtype),
        torch.randn(2, rows // 2, 4096, device=dev, dtype=dtype),
    )
    calls = []
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, _f=torch._scaled_mm, **k: calls.append(1) or _f(*a, **k))
    y_qkv = qkv(x, norm=norm, residual=res)
    y_gate_up = gate_up(x3, norm=norm, swiglu=True)
    y_down = down(h3, residual=res3)
    assert len(calls) == (3 if rows > FP8_SKINNY_MAX_M else 0)  # _scaled_mm above, the skinny kernel up to

    def exact(layer, x, norm):  # float32 GEMM of the kernel-quantized activations
        qx, sx = quantize_rows(x.reshape(-1, x.shape[-1]), norm)
        y = F.linear(qx.float() * sx, layer.dequantize(torch.float32))
        return y.view(*x.shape[:-1], -1) + (0 if layer.bias is None else layer.bias.float())

    norm_args = (norm.weight, norm.eps)
    # (output less residual, float32 W8A8, activations unrounded, max |error| / max |want|, relative error there)
    cases = [
        (y_qkv - res, exact(qkv, x, norm_args), F.linear(norm(x), qkv.dequantize(dtype), qkv.bias), 2**-7, REL_STEP),
        (
            y_gate_up,
            swiglu_rounded(exact(gate_up, x3, norm_args), dtype),
            swiglu_rounded(F.linear(norm(x3), gate_up.dequantize(dtype), gate_up.bias).float(), dtype),
            2**-6,  # gate or up a bf16 step apart where the sums round differently
            2 * REL_STEP,  # a product of two rounded sums
        ),
        (y_down - res3, exact(down, h3, None), F.linear(h3, down.dequantize(dtype)), 2**-7, REL_STEP),
    ]
    for y, want, unrounded, bound, rel in cases:
        assert y.shape == want.shape and y.dtype == dtype
        # bf16 roundings (the output, then the residual add) of values ~ the residual's (4.5 sigma)
        assert (y.float() - want).norm() / want.norm() < 2e-2
        assert (y.float() - want).abs().max() <= bound * (want.abs().max() + 4.5)
        assert (y.float() - unrounded.float()).norm() / unrounded.float().norm() < rel
    check_in_cuda_graph(qkv, x)
