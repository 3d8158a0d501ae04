"""The Triton skinny linear (`blockspec.layers.kernels.skinny_linear`) against F.linear: W8A8, FP8
x and weights with per-row scales (`skinny_scaled_mm`, Fp8Linear's CUDA path), and bf16/fp16/fp32
x and weights (`skinny_linear`, the `linear` op's CUDA path), on the GEMV (M = 1) and the swap-AB
(M > 1, split-K) kernels; and the layer's ops that run apart from the GEMM on CUDA (RMSNorm and
SwiGLU kernels) against their references.

With a GPU the kernels run for real (bf16/fp16/fp32, drafter and target shapes, CUDA-graph
capture). Without one they run in Triton's interpreter (fp16/fp32, small odd shapes; the
interpreter's tl.dot mishandles bf16, which it stores as uint16), which must be switched on before
triton is first imported: so on CPU this file runs again in a subprocess with TRITON_INTERPRET=1
(test_kernels_in_interpreter), as test_kernels_attention.py does. Skipped without triton."""

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("triton")

from conftest import CUDA, interpreter_test, runs_kernel, swiglu_rounded

from blockspec.layers import linear as linear_module
from blockspec.layers.activation import silu_mul, silu_mul_ref
from blockspec.layers.fast_path import reference_ops
from blockspec.layers.kernels import skinny_linear as kernel
from blockspec.layers.norm import RMSNorm, rms_norm, rms_norm_ref
from blockspec.layers.quantization import FP8_SKINNY_MAX_M, Fp8Linear, dequantize_weight, fp8_supported, quantize_weight

test_kernels_in_interpreter = interpreter_test(__file__)
cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")
DEVICE = torch.device("cuda" if CUDA else "cpu")


def check_kernel(M, N, K, dtype, bias, config=None, fp8=True, seed=0, norm=False, swiglu=False, residual=False):
    """The kernel against F.linear in float32, with the RMSNorm prologue (`norm`: True, or "folded"
    for one without a weight), the SwiGLU epilogue (`swiglu`: a weight of 2N rows) or a residual add."""
    gen = torch.Generator().manual_seed(seed)
    rows = 2 * N if swiglu else N
    w = torch.randn(rows, K, generator=gen) * torch.rand(rows, 1, generator=gen) * 0.1
    b = (torch.randn(rows, generator=gen) * 0.1).to(DEVICE, dtype) if bias else None
    x = torch.randn(M, K, generator=gen).to(DEVICE, dtype)
    norm_args = None
    if norm:  # mean square 0.01 against eps 0.01: a wrong eps shows
        g = None if norm == "folded" else (torch.rand(K, generator=gen) + 0.5).to(DEVICE, dtype)
        x, norm_args = x * 0.1, (g, 1e-2)
    res = torch.randn(M, N, generator=gen).to(DEVICE, dtype) if residual else None
    if fp8:  # W8A8: x quantized by the torch reference (the norm applied before, in float32)
        assert not norm, "W8A8 takes its norm from quantize_rows"
        if CUDA and not fp8_supported(DEVICE):
            pytest.skip("W8A8 needs FP8 tensor cores (Hopper+)")
        qx, sx = quantize_weight(x)
        q, scale = quantize_weight(w.to(DEVICE))
        y = kernel.skinny_scaled_mm(qx, sx, q, scale, dtype, b, res, config, swiglu)
        x, w_ref = dequantize_weight(qx, sx, torch.float32), dequantize_weight(q, scale, torch.float32)
    else:
        w_ref = w.to(DEVICE, dtype)
        y = kernel.skinny_linear(x, w_ref, b, config, norm_args, swiglu, res)
    assert y.shape == (M, N) and y.dtype == dtype
    if norm_args is None:
        h = x.float()
    else:
        h = rms_norm_ref(x.float(), None if norm_args[0] is None else norm_args[0].float(), norm_args[1])
    ref = F.linear(h, w_ref.float(), None if b is None else b.float())
    if swiglu:
        ref = swiglu_rounded(ref, dtype)
    ref = ref if res is None else ref + res.float()
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    if fp8 and CUDA:  # FP8 MMAs add with ~14 bits within a K step (the interpreter's are exact)
        tol = max(tol, 2**-9)
    if swiglu and dtype != torch.float32:  # gate or up a rounding step apart where the sums round differently
        tol *= 2
    tol *= ref.abs().max().item()
    err = (y.float() - ref).abs().max().item()
    assert err <= tol, (M, N, K, dtype, config, fp8, norm, swiglu, residual, err, tol)


@pytest.fixture(params=[True, False], ids=["tma", "pointers"])
def tile_loads(request, monkeypatch) -> None:
    """Run the test twice: the MMA kernel's tiles loaded by TMA where `_tma_sources` allows it
    (`test_tiles_load_by_tma_where_aligned`), then by pointers only."""
    if not request.param:
        monkeypatch.setattr(kernel, "_tma_sources", lambda *args: None)


INTERPRETED_CASES = [  # M, N, K, dtype, bias, config (None: choose_config)
    (1, 200, 300, torch.float16, True, None),  # GEMV, K not a multiple of its block
    (1, 40, 1024, torch.float32, False, None),  # GEMV, even K
    (16, 96, 512, torch.float32, False, None),
    (37, 130, 100, torch.float16, True, None),
    (1, 64, 256, torch.float16, False, "split"),
    (16, 72, 96, torch.float32, True, "split"),
    (37, 40, 70, torch.float32, False, "odd-split"),
    (300, 48, 40, torch.float16, True, None),
    (21, 72, 208, torch.float16, True, None),  # aligned rows (TMA), edge boxes past M and K
]


def resolve_config(spec):
    if spec == "split":
        return kernel.SkinnyConfig(16, 32, 32, split_k=2)
    if spec == "odd-split":  # block_k 32: FP8 MMAs take K in steps of 32
        return kernel.SkinnyConfig(32, 16, 32, split_k=3)
    if spec == "gemv-steps":  # several K steps, whatever K the tuned one-row tiles take at once
        return kernel.SkinnyConfig(1, 16, 64)
    return None


@runs_kernel
@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "unscaled"])
@pytest.mark.parametrize("M,N,K,dtype,bias,config", INTERPRETED_CASES)
def test_kernel_matches_reference_small(M, N, K, dtype, bias, config, fp8, tile_loads) -> None:
    check_kernel(M, N, K, dtype, bias, resolve_config(config), fp8)


FUSED_CASES = [  # M, N, K, dtype, config, norm, swiglu, residual
    (1, 200, 300, torch.float16, None, True, False, False),  # GEMV, K not a multiple of its block
    (1, 40, 1024, torch.float32, None, False, True, False),
    (16, 96, 512, torch.float32, None, True, False, True),
    (1, 130, 100, torch.float16, None, True, True, False),  # gate|up at one row
    (16, 96, 512, torch.float32, None, True, True, False),  # gate|up at 16 rows
    (5, 40, 70, torch.float16, "split", False, True, False),  # SwiGLU: split-K turned off
    (37, 130, 100, torch.float16, None, True, False, True),
    (16, 72, 96, torch.float32, "split", True, False, True),  # sums of squares across splits
    (37, 40, 70, torch.float32, "odd-split", False, False, True),
    (37, 40, 70, torch.float16, "odd-split", True, False, False),
    (1, 200, 300, torch.float16, None, "folded", False, True),  # the norm's weight folded into w
    (16, 96, 512, torch.float32, None, "folded", True, False),
    (16, 72, 96, torch.float32, "split", "folded", False, True),
]


@runs_kernel
@pytest.mark.parametrize("M,N,K,dtype,config,norm,swiglu,residual", FUSED_CASES)
def test_fused_norm_swiglu_and_residual_small(M, N, K, dtype, config, norm, swiglu, residual, tile_loads) -> None:
    cfg = resolve_config(config)
    check_kernel(M, N, K, dtype, True, cfg, False, norm=norm, swiglu=swiglu, residual=residual)
    check_kernel(M, N, K, dtype, True, cfg, True, swiglu=swiglu, residual=residual)  # W8A8: no norm


@runs_kernel
@pytest.mark.parametrize("K", [256, 300])
@pytest.mark.parametrize("norm,swiglu", [(False, False), (True, False), (True, True)])
def test_gemv_over_several_k_steps(K, norm, swiglu):
    cfg = resolve_config("gemv-steps")
    check_kernel(1, 40, K, torch.float32, True, cfg, False, norm=norm, swiglu=swiglu, residual=not swiglu)


@runs_kernel
def test_tiles_load_by_tma_where_aligned(monkeypatch):
    """TMA where each tile row starts 16-byte aligned (K * element bytes and the base): the same
    shape by pointers at an odd K or a misaligned base, and with SwiGLU (interleaved rows, no box);
    not at one row (the GEMV)."""
    cases = [  # M, K, offset of x's first element, swiglu, by TMA
        (16, 64, 0, False, True),
        (16, 60, 0, False, False),  # fp16 rows of 120 bytes
        (16, 64, 1, False, False),
        (16, 64, 0, True, False),
        (1, 64, 0, False, False),
    ]
    used, sources = [], kernel._tma_sources
    monkeypatch.setattr(kernel, "_tma_sources", lambda *args: used.append(sources(*args)) or used[-1])
    for M, K, offset, swiglu, expected in cases:
        used.clear()
        x = torch.randn(M * K + offset, device=DEVICE, dtype=torch.float16)[offset:].view(M, K)
        w = torch.randn(64, K, device=DEVICE, dtype=torch.float16)
        y = kernel.skinny_linear(x, w, swiglu=swiglu)
        ref = F.linear(x.float(), w.float())
        torch.testing.assert_close(y.float(), swiglu_rounded(ref, x.dtype) if swiglu else ref, rtol=4e-3, atol=4e-3)
        assert [d is not None for d in used] == ([expected] if M > 1 else []), (M, K, offset, swiglu)
    monkeypatch.setattr(kernel, "TensorDescriptor", None)  # a triton without host descriptors
    used.clear()
    x, w = (
        torch.randn(16, 64, device=DEVICE, dtype=torch.float16),
        torch.randn(64, 64, device=DEVICE, dtype=torch.float16),
    )
    torch.testing.assert_close(kernel.skinny_linear(x, w).float(), F.linear(x.float(), w.float()), rtol=4e-3, atol=4e-3)
    assert used == [None]


@runs_kernel
def test_gemv_tile_follows_its_fused_ops(monkeypatch):
    chosen, choose = [], kernel.choose_config
    monkeypatch.setattr(kernel, "choose_config", lambda *args: chosen.append(args[-1]) or choose(*args))
    for norm in (False, True, "folded"):
        check_kernel(1, 40, 96, torch.float32, False, None, False, norm=norm)
    assert chosen == [None, "norm", "rms"]


@runs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequant_kernel_is_the_reference_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(37, 300, generator=gen) * torch.logspace(-4, 2, 37)[:, None]
    q, s = quantize_weight(w.to(DEVICE))
    expected = dequantize_weight(q, s, dtype, use_kernel=False)
    got = kernel.dequantize_fp8(q, s, dtype)
    if CUDA or dtype != torch.bfloat16:
        assert torch.equal(got, expected)
    else:  # the interpreter casts float32 -> bf16 by truncation, the GPU rounds to nearest even
        torch.testing.assert_close(got, expected, rtol=2**-7, atol=0)


def test_choose_config_for_model_shapes():
    shapes = [(4096, 4096), (1024, 4096), (6144, 4096), (12288, 4096), (24576, 4096), (4096, 12288)]
    shapes += [(10240, 4096), (4096, 20480), (151936, 4096)]  # fused K/V, fc, LM head
    for M, (N, K), elem_bytes, prologue in itertools.product(
        (1, 16, 37, 256, 1024), shapes, (1, 2, 4), (None, "norm", "rms")
    ):
        c = kernel.choose_config(M, N, K, 132, elem_bytes, prologue)
        if M == 1 and elem_bytes > 1:  # the GEMV kernel: no split, no MMA tile
            assert c.block_m == 1 and c.split_k == 1 and c.block_k <= K, (N, K, c)
            continue
        k_steps = -(-K // c.block_k)
        assert k_steps % c.split_k == 0 and k_steps // c.split_k >= 2, (M, N, K, c)
        assert c.block_m >= 16 and c.block_n >= 16 and c.block_k >= 32
        assert (c.block_n + c.block_m) * elem_bytes * c.block_k * c.num_stages <= 192 * 1024
        tiles = -(-M // c.block_m) * -(-N // c.block_n)
        assert c.split_k == 1 or tiles * c.split_k // 2 < 2 * 132, (M, N, K, c)
    assert kernel.choose_config(16, 1024, 4096, 132, 1).split_k > 1  # W8A8 k/v projection: too few tiles alone
    assert kernel.choose_config(16, 1024, 4096, 132, 2).split_k == 1  # bf16: streams best unsplit
    assert kernel.choose_config(16, 151936, 4096, 132, 1).split_k == 1  # LM head: plenty
    assert kernel.choose_config(1, 4096, 4096, 132, 1).block_m == 16  # W8A8 at one row: the MMA kernel
    assert kernel.choose_config(4, 64, 8, 132, 1).block_k == 32  # FP8 MMAs: K steps of 32 at least


@runs_kernel
@pytest.mark.parametrize(
    "rows,dtype,kind",
    [
        (1, torch.float32, "swiglu"),  # the GEMV's epilogue, with the norm
        (5, torch.float32, "swiglu"),  # the MMA kernel's
        (5, torch.float32, "norm"),  # the norm on the MMA kernel's weight tile
        (5, torch.float16, "norm"),  # the same in fp16, with norm weights ~200 on the weight tile
    ],
)
def test_fused_linear_matches_the_unfused_ops(rows, dtype, kind):
    """`fused_linear` (the kernel with the norm as its prologue, SwiGLU or the residual add as its
    epilogue), with bias, against the reference `dense`."""
    gen = torch.Generator().manual_seed(rows)
    K, N = 96, 40
    swiglu = kind == "swiglu"
    norm = RMSNorm(K, 1e-2).to(DEVICE, dtype)
    large = 200.0 if dtype == torch.float16 else 1.0
    norm.weight.data = ((torch.rand(K, generator=gen) + 0.5) * large).to(DEVICE, dtype)
    x = (torch.randn(rows, K, generator=gen) * 0.1).to(DEVICE, dtype)
    out = 2 * N if swiglu else N
    bias = torch.randn(out, generator=gen).to(DEVICE, dtype)
    res = None if swiglu else torch.randn(rows, N, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(out, K, generator=gen) * 0.1).to(DEVICE, dtype)
    y = linear_module.fused_linear(x, w, bias, norm, swiglu, res)
    h = rms_norm_ref(x.float(), norm.weight.float(), norm.eps)
    ref = linear_module.dense(h, w.float(), bias.float(), None if res is None else res.float(), None, swiglu)
    tol = (1e-5 if dtype == torch.float32 else 4e-3) * ref.abs().max().item()
    assert (y.float() - ref).abs().max().item() <= tol, (rows, dtype, kind)


@runs_kernel
@pytest.mark.parametrize("fused", ["plain", "norm_swiglu", "residual", "split_residual"])
def test_invariant_linear_gives_a_row_the_same_bits_at_any_row_count(fused):
    """Row invariance (`linear_module.invariant_linear`): the MMA kernel with a fixed split of K at
    every row count (none, or halves where K is long: `split_residual`, as down_proj), one row too
    (no GEMV), its norm by the one-program-a-row kernel; each row of any call equals that row alone,
    bit for bit, and the unfused ops within rounding. On the GPU across tile shapes too (an MMA
    chain sums K in the same order whatever BLOCK_K and BLOCK_M); the interpreter's tl.dot is
    numpy's, whose rounding follows the tile, so there only within one."""
    from blockspec.layers.kernels.skinny_linear import invariant_split_k

    dtype = torch.bfloat16 if CUDA else torch.float16
    gen = torch.Generator().manual_seed(0)
    N, K, rows = 96, 1024 if fused == "split_residual" else 320, 200 if CUDA else 70
    assert invariant_split_k(N, K) == (2 if fused == "split_residual" else 1)
    w = (torch.randn(2 * N if fused == "norm_swiglu" else N, K, generator=gen) * 0.05).to(DEVICE, dtype)
    x = torch.randn(rows, K, generator=gen).to(DEVICE, dtype)
    res = torch.randn(rows, N, generator=gen).to(DEVICE, dtype) if fused.endswith("residual") else None
    norm = RMSNorm(K, 1e-6).to(DEVICE, dtype) if fused == "norm_swiglu" else None
    swiglu = fused == "norm_swiglu"

    def call(i, j):
        return linear_module.invariant_linear(x[i:j], w, None, norm, swiglu, None if res is None else res[i:j])

    alone = torch.cat([call(i, i + 1) for i in range(rows)])
    for i, j in [(0, 2), (3, 19)] + ([(5, 38), (0, 70), (0, rows)] if CUDA else []):  # 200: `invariant_config`'s band
        assert torch.equal(call(i, j), alone[i:j]), (i, j)
    expected = linear_module.dense(x, w, None, res, norm, swiglu)
    torch.testing.assert_close(alone.float(), expected.float(), rtol=2e-2, atol=2e-2)


@runs_kernel
def test_rms_norm_kernel_is_the_reference_a_row_at_a_time():
    from blockspec.layers.kernels.rms_norm import rms_norm_rows

    gen = torch.Generator().manual_seed(0)
    for dtype, H in [(torch.float32, 576), (torch.float16, 4096)]:
        x = torch.randn(37, H, generator=gen).to(DEVICE, dtype)
        w = (torch.rand(H, generator=gen) + 0.5).to(DEVICE, dtype)
        for weight in (w, None):
            together = rms_norm_rows(x, weight, 1e-6)
            alone = torch.cat([rms_norm_rows(x[i : i + 1], weight, 1e-6) for i in range(37)])
            assert torch.equal(together, alone)
            tol = 1e-5 if dtype == torch.float32 else 2e-3
            torch.testing.assert_close(together, rms_norm_ref(x, weight, 1e-6), rtol=tol, atol=tol)


@runs_kernel
def test_swiglu_kernel_is_the_reference_a_row_at_a_time():
    """The SwiGLU kernel against the eager reference (SiLU rounded to the dtype, then the product),
    over rows of odd width (a masked last block) and more than one block, a strided gate|up view,
    and none: each row the same alone as among the others."""
    from blockspec.layers.kernels.swiglu import BLOCK, swiglu_rows

    gen = torch.Generator().manual_seed(0)
    for dtype, N in [(torch.float32, 37), (torch.float16, BLOCK + 300)]:
        gate_up = (torch.randn(13, 2 * N, generator=gen) * 4).to(DEVICE, dtype)
        together = swiglu_rows(gate_up)
        assert torch.equal(together, torch.cat([swiglu_rows(gate_up[i : i + 1]) for i in range(13)]))
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(together, silu_mul_ref(gate_up), rtol=tol, atol=tol)
        wide = torch.cat([gate_up, gate_up], -1)[:, : 2 * N]  # rows strided by 4N
        torch.testing.assert_close(swiglu_rows(wide.view(13, 1, 2 * N)), together.view(13, 1, N), rtol=0, atol=0)
    assert swiglu_rows(torch.empty(0, 8, device=DEVICE)).shape == (0, 4)
    with pytest.raises(AssertionError, match="even width"):
        swiglu_rows(torch.empty(2, 7, device=DEVICE))


@cuda
@pytest.mark.cuda
def test_norm_and_swiglu_run_their_kernels_on_cuda(monkeypatch):
    """On CUDA without grad the ops run their Triton kernels: SwiGLU in bf16 within one ulp of SiLU
    rounded to bf16 times up (the reference's roundings; Triton's exp is not torch's), RMSNorm
    close to its reference; with grad on, the references themselves."""
    from blockspec.layers.kernels import rms_norm as norm_kernel
    from blockspec.layers.kernels import swiglu as swiglu_kernel

    norms, swiglus = (
        count_kernel_calls(monkeypatch, "rms_norm_rows", norm_kernel),
        count_kernel_calls(monkeypatch, "swiglu_rows", swiglu_kernel),
    )
    torch.manual_seed(0)
    x = torch.randn(5, 2, 1152, device="cuda", dtype=torch.bfloat16) * 4
    w = torch.rand(1152, device="cuda", dtype=torch.bfloat16) + 0.5
    with torch.no_grad():
        normed, activated = rms_norm(x, w, 1e-6), silu_mul(x)
    assert (len(norms), len(swiglus)) == (1, 1)
    gate, up = x.float().chunk(2, -1)
    rounded_silu = (F.silu(gate).bfloat16().float() * up).bfloat16()
    ulp = 2.0 ** (torch.floor(torch.log2(rounded_silu.float().abs().clamp_min(1e-30))) - 7)
    assert ((activated.float() - rounded_silu.float()).abs() <= ulp).all()
    torch.testing.assert_close(normed, rms_norm_ref(x, w, 1e-6), rtol=1e-2, atol=1e-2)
    assert torch.equal(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))  # grad on: the reference
    assert torch.equal(silu_mul(x), silu_mul_ref(x))
    assert (len(norms), len(swiglus)) == (1, 1)


@runs_kernel
def test_kernel_empty_and_batched_input():
    dtype = torch.float32
    w = torch.randn(40, 32, device=DEVICE)
    q, s = quantize_weight(w)
    assert kernel.skinny_linear(torch.randn(0, 32, device=DEVICE, dtype=dtype), w).shape == (0, 40)
    x = torch.randn(2, 3, 32, device=DEVICE, dtype=dtype)
    torch.testing.assert_close(kernel.skinny_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    qx, sx = quantize_weight(x.view(6, 32))
    y = kernel.skinny_scaled_mm(qx.view(2, 3, 32), sx, q, s, dtype)
    want = F.linear(dequantize_weight(qx, sx, dtype), dequantize_weight(q, s, dtype)).view(2, 3, 40)
    torch.testing.assert_close(y, want, rtol=0, atol=(2**-9 if CUDA else 1e-5) * want.abs().max().item())
    with pytest.raises(AssertionError, match="x's dtype"):
        kernel.skinny_linear(x, w.to(torch.float16))
    with pytest.raises(AssertionError, match="FP8 x and weight"):
        kernel.skinny_scaled_mm(x, sx, q, s, dtype)


# -- the kernels on a GPU -------------------------------------------------------------------------


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "unscaled"])
@pytest.mark.parametrize("M", [1, 16, 37, 256, 1030])
def test_kernel_matches_reference_cuda_bf16(M, fp8):
    for N, K, bias in ((200, 300, True), (1024, 4096, False), (4096, 4096, True), (4096, 12288, False)):
        check_kernel(M, N, K, torch.bfloat16, bias, fp8=fp8)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "unscaled"])
@pytest.mark.parametrize("M", [1, 16, 37])
def test_fused_norm_swiglu_and_residual_cuda_bf16(M, fp8):
    for N, K, norm, swiglu, residual in (
        (6144, 4096, True, False, False),  # q|k|v
        (12288, 4096, True, True, False),  # gate|up
        (4096, 12288, False, False, True),  # down
        (4096, 4096, False, False, True),  # o
        (1024, 4096, True, False, True),  # split-K for FP8
    ):
        check_kernel(M, N, K, torch.bfloat16, False, fp8=fp8, norm=norm and not fp8, swiglu=swiglu, residual=residual)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("M", [1, 37, 1030])
def test_kernel_matches_reference_cuda_other_dtypes(dtype, M):
    for N, K, bias in ((200, 300, True), (1024, 4096, False)):
        check_kernel(M, N, K, dtype, bias)
        check_kernel(M, N, K, dtype, bias, fp8=False)


def check_in_cuda_graph(layer: nn.Module, x: torch.Tensor) -> None:
    """Capture `layer` in a CUDA graph (after warm-up) and replay it on new input."""
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(static_x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = layer(static_x)
    static_x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(static_y, layer(static_x), rtol=0, atol=0)


def count_kernel_calls(monkeypatch, name: str = "skinny_linear", module=kernel) -> list:
    calls, original = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


@cuda
@pytest.mark.cuda
@pytest.mark.skipif(CUDA and not fp8_supported("cuda"), reason="W8A8 needs Hopper+")
@torch.no_grad()  # grad mode takes the reference path
def test_fp8_linear_module_on_cuda_uses_kernel_and_graphs(monkeypatch):
    """Up to FP8_SKINNY_MAX_M rows Fp8Linear runs the skinny W8A8 kernel, above it not (_scaled_mm,
    test_kernels_quantize.py); both against the reference path, and the kernel in a CUDA graph."""
    torch.manual_seed(0)
    layer = Fp8Linear.from_linear(nn.Linear(4096, 1024, device="cuda", dtype=torch.bfloat16))
    calls = count_kernel_calls(monkeypatch, "skinny_scaled_mm")
    for rows, kernel_calls in ((1, 1), (16, 2), (FP8_SKINNY_MAX_M, 3), (FP8_SKINNY_MAX_M + 1, 3)):
        x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
        y, ref = layer(x), layer.forward_reference(x)
        assert len(calls) == kernel_calls, rows
        torch.testing.assert_close(y.float(), ref.float(), rtol=0, atol=2e-2 * ref.abs().max().item())
    check_in_cuda_graph(layer, torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16))


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 16])
def test_linear_uses_kernel_for_few_rows_on_cuda(monkeypatch, rows):
    torch.manual_seed(0)
    layer = linear_module.Linear(4096, 6144, bias=True, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    calls = count_kernel_calls(monkeypatch)
    with torch.inference_mode():
        y = layer(x)
        assert calls, "Linear did not use the Triton kernel"
        ref = F.linear(x.float(), layer.weight.float(), layer.bias.float())
        torch.testing.assert_close(y.float(), ref, rtol=0, atol=1e-2 * ref.abs().max().item())
        n = len(calls)
        big = torch.randn(linear_module.LINEAR_MAX_M + 1, 4096, device="cuda", dtype=torch.bfloat16)
        assert torch.equal(layer(big), F.linear(big, layer.weight, layer.bias)) and len(calls) == n  # cuBLAS
        check_in_cuda_graph(layer, x)
    with torch.enable_grad():  # training keeps F.linear
        layer(x)
    assert len(calls) == n + 3  # the graph test's warm-up, capture and check, not the grad-mode call


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 16, 17])
def test_linear_fusions_match_the_unfused_ops_on_cuda(monkeypatch, rows):
    """`Linear` as a decoder layer calls it: q|k|v with the RMSNorm prologue, gate|up with the norm
    and the SwiGLU epilogue, down with the residual add: the fused kernel (<= LINEAR_MAX_M rows at
    Qwen3-8B's shapes) or the unfused path (cuBLAS), against the ops one by one in `reference_ops`
    (bf16 rounding apart)."""
    check_layer_linears(monkeypatch, rows, 4096, 12288, 6144, rows <= linear_module.LINEAR_MAX_M)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("rows", [17, 64, 65])
def test_small_weights_take_the_kernel_up_to_more_rows_on_cuda(monkeypatch, rows):
    """A small model's layers (SmolLM2-135M's shapes, each weight within SMALL_WEIGHT) take the fused
    kernel up to SMALL_LINEAR_MAX_M rows, cuBLAS above, and match the ops one by one."""
    check_layer_linears(monkeypatch, rows, 576, 1536, 960, rows <= linear_module.SMALL_LINEAR_MAX_M)


def check_layer_linears(monkeypatch, rows: int, hidden: int, inter: int, qkv_out: int, kernel: bool) -> None:
    """A decoder layer's linears at `rows` rows: the fused kernel serves all three (`kernel`) or
    none, and each equals the unfused ops within bf16 rounding."""
    torch.manual_seed(0)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    qkv = linear_module.Linear(hidden, qkv_out, bias=False, device=dev, dtype=dtype).requires_grad_(False)
    gate_up = linear_module.Linear(hidden, 2 * inter, bias=False, device=dev, dtype=dtype).requires_grad_(False)
    down = linear_module.Linear(inter, hidden, bias=False, device=dev, dtype=dtype).requires_grad_(False)
    norm = RMSNorm(hidden, 1e-6).to(dev, dtype).requires_grad_(False)
    norm.weight.uniform_(0.5, 1.5)
    x, res = torch.randn(rows, hidden, device=dev, dtype=dtype), torch.randn(rows, hidden, device=dev, dtype=dtype)
    h = torch.randn(rows, inter, device=dev, dtype=dtype)
    calls = count_kernel_calls(monkeypatch)
    with torch.inference_mode():
        got = qkv(x, norm=norm), gate_up(x, norm=norm, swiglu=True), down(h, residual=res)
        assert len(calls) == (3 if kernel else 0)
        with reference_ops():
            want = (
                F.linear(norm(x), qkv.weight),
                silu_mul(F.linear(norm(x), gate_up.weight)),
                res + F.linear(h, down.weight),
            )
    for y, ref in zip(got, want, strict=True):
        torch.testing.assert_close(y.float(), ref.float(), rtol=0, atol=2e-2 * ref.abs().max().item())
