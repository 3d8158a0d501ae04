"""Skinny linear in Triton: y = residual + prologue(x) @ (w * scale[:, None]).T + bias for the few
rows of a decode, verify or propose step. It serves two callers with one contract:
- `blockspec.layers.linear.linear`: bf16/fp16 weights, no scale, up to `LINEAR_MAX_M` rows, where
  it reads the weight faster than cuBLAS (H200, a one-off sweep over the Qwen3-8B target's shapes:
  3.87 against 4.16 ms of GEMMs a decode step at M = 1, 4.01 against 4.18 at M = 16;
  `python -m blockspec.bench.fp8_bench` times the drafter's shapes, column "linear µs");
- `blockspec.layers.quantization.Fp8Linear`: float8_e4m3fn weights with one float32 scale per
  output row (E4M3 values are exact in bf16/fp16; the scale commutes with the K reduction, so it is
  applied once to the fp32 accumulator in the epilogue, with the bias and the cast).
x and y stay in the activation dtype (bf16/fp16, or fp32 with exact fp32 products); accumulation is
fp32. At small M the GEMM is bound by reading the weight, so both kernels only stream it, and the
small elementwise ops around a decoder layer's GEMMs ride along instead of costing a launch and a
round trip each:
- prologue RMSNorm (qkv and gate|up): the squares of each x tile are summed as it is read, and
  the norm weight multiplies the x tile (GEMV) or the weight tile (MMA: the weight is the register
  operand, so x reaches the MMA as loaded); the row's 1 / rms is a per-row factor, applied to the
  accumulator at the end (the normed x is never stored);
- prologue SwiGLU (down): x is gate|up, and the input tile is SiLU(gate) * up;
- epilogue residual add (o and down): the output is the residual stream itself.

M = 1, `_gemv_kernel`: a program owns BLOCK_N rows of w and walks K, multiply-adding on the CUDA
cores into an fp32 [BLOCK_N, BLOCK_K] tile summed once at the end (no MMA: with one row it would
waste 15/16 of its lanes and add a layout shuffle per tile). It is launched with programmatic
dependent launch (`blockspec.layers.kernels.pdl`: measured there). Prefetching the first weight
tiles to L2 before its wait for the previous kernel made it slower (36 layers at M = 1: 3,770 µs
without, 3,838 with 2 tiles, 4,086 with 4).

M > 1, `_skinny_kernel`, "swap AB": a program computes the transposed tile acc[BLOCK_N, BLOCK_M] =
w_tile @ x_tile.T, so the weight rows fill the MMA's large M side (64, the wgmma granule on Hopper;
the converted weight can be its register operand) and the few activation rows the narrow side
(>= 16 for tl.dot; rows past M are clamped, not masked, and the store is masked).

Split-K: when the (M, N) tiles are too few to keep every SM streaming (N = 1024..4096 at small M),
the K range is cut into SPLIT_K chunks handled by separate programs, each writing an fp32 partial
tile to a workspace; a second kernel sums the partials in a fixed order (deterministic, no
atomics) and applies the 1 / rms factor (summing the splits' sums of
squares), scale, bias, residual and cast. Launch shapes depend only on (M, N, K), there is no host
synchronisation, and the workspace comes from the caching allocator, so calls can be captured in
CUDA graphs (warm up first: the first call compiles).

`dequantize_fp8` is FP8's large-M path's first half (then cuBLAS): one pass, float32 product
rounded once, equal bit for bit to the torch reference.
"""

import dataclasses

import torch
import triton
import triton.language as tl

from blockspec.layers.kernels import num_sms
from blockspec.layers.kernels.pdl import await_previous_kernel, pdl_launch
from blockspec.layers.kernels.tiles import load_tile, swiglu_tile

REDUCE_BLOCK = 1024
DEQUANT_BLOCK = 4096


@triton.jit
def _epilogue(acc, sq, offs, n, mask, K, eps, scale_ptr, bias_ptr, res_ptr, HAS_SCALE, HAS_BIAS, NORM, RESIDUAL):
    """acc / rms (from the row's sum of squares `sq`) * scale[n] + bias[n] + residual[offs]. `n`:
    the output columns clamped into range (read unmasked, once per column; past N never stored)."""
    if NORM:
        acc = acc * tl.rsqrt(sq / K + eps)
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + n)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n).to(tl.float32)
    if RESIDUAL:
        acc += tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _skinny_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    norm_ptr,
    res_ptr,
    y_ptr,
    ws_ptr,
    sq_ptr,
    M,
    N,
    K,
    eps,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    K_ITERS: tl.constexpr,  # BLOCK_K steps per split (constexpr: a known trip count)
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NORM: tl.constexpr,
    RESIDUAL: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_k * K_ITERS * BLOCK_K + tl.arange(0, BLOCK_K)
    # Clamp instead of masking on rows/columns: loads stay in bounds, the store is masked.
    rows_n = (offs_n % N).to(tl.int64)  # N * K may pass 2**31 (LM heads)
    rows_m = offs_m % M
    w_ptrs = w_ptr + rows_n[:, None] * stride_wn + offs_k[None, :] * stride_wk  # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + rows_m[None, :] * stride_xm + offs_k[:, None] * stride_xk  # [BLOCK_K, BLOCK_M]
    acc = tl.full((BLOCK_N, BLOCK_M), 0.0, tl.float32)
    sq = tl.full((BLOCK_M,), 0.0, tl.float32)
    for _ in range(K_ITERS):
        w = load_tile(w_ptrs, offs_k[None, :] < K, EVEN_K)
        x = load_tile(x_ptrs, offs_k[:, None] < K, EVEN_K)
        if NORM:  # the norm weight scales the weight tile, the register operand: x stays as loaded
            g = load_tile(norm_ptr + offs_k, offs_k < K, EVEN_K).to(tl.float32)
            w = w.to(tl.float32) * g[None, :]
            sq += tl.sum(x.to(tl.float32) * x.to(tl.float32), axis=0)
        if IEEE:
            acc = tl.dot(w.to(x.dtype), x, acc, input_precision="ieee")
        else:
            acc = tl.dot(w.to(x.dtype), x, acc)
        w_ptrs += BLOCK_K * stride_wk
        x_ptrs += BLOCK_K * stride_xk
        offs_k += BLOCK_K
    mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
    offs = offs_m[None, :] * N + offs_n[:, None]  # y, the residual and each workspace slice: [M, N]
    if SPLIT_K == 1:
        acc = _epilogue(
            acc,
            sq[None, :],
            offs,
            rows_n[:, None],
            mask,
            K,
            eps,
            scale_ptr,
            bias_ptr,
            res_ptr,
            HAS_SCALE,
            HAS_BIAS,
            NORM,
            RESIDUAL,
        )
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:  # partial sums to the workspace [SPLIT_K, M, N]; sums of squares [SPLIT_K, M], once per row
        tl.store(ws_ptr + pid_k * M * N + offs, acc, mask=mask)
        if NORM:
            tl.store(sq_ptr + pid_k * M + offs_m, sq, mask=(offs_m < M) & (pid_n == 0))


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    norm_ptr,
    res_ptr,
    y_ptr,
    N,
    K,
    eps,
    stride_xk,
    stride_wn,
    stride_wk,
    K_ITERS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NORM: tl.constexpr,
    GATED: tl.constexpr,
    RESIDUAL: tl.constexpr,
    EVEN_K: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows_n = (offs_n % N).to(tl.int64)  # clamped: loads stay in bounds, the store is masked
    w_ptrs = w_ptr + rows_n[:, None] * stride_wn + offs_k[None, :] * stride_wk
    acc = tl.full((BLOCK_N, BLOCK_K), 0.0, tl.float32)
    sq = tl.full((BLOCK_K,), 0.0, tl.float32)
    await_previous_kernel(PDL)
    for _ in range(K_ITERS):
        w = load_tile(w_ptrs, offs_k[None, :] < K, EVEN_K)
        if GATED:
            x = swiglu_tile(x_ptr + offs_k * stride_xk, K * stride_xk, offs_k < K, EVEN_K).to(tl.float32)
        else:
            x = load_tile(x_ptr + offs_k * stride_xk, offs_k < K, EVEN_K).to(tl.float32)
        if NORM:
            sq += x * x
            x = x * load_tile(norm_ptr + offs_k, offs_k < K, EVEN_K).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
        w_ptrs += BLOCK_K * stride_wk
        offs_k += BLOCK_K
    mask = offs_n < N
    y = _epilogue(
        tl.sum(acc, axis=1),
        tl.sum(sq),
        offs_n,
        rows_n,
        mask,
        K,
        eps,
        scale_ptr,
        bias_ptr,
        res_ptr,
        HAS_SCALE,
        HAS_BIAS,
        NORM,
        RESIDUAL,
    )
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _splitk_reduce_kernel(
    ws_ptr,
    sq_ptr,
    scale_ptr,
    bias_ptr,
    res_ptr,
    y_ptr,
    M,
    N,
    K,
    eps,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NORM: tl.constexpr,
    RESIDUAL: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    m = offs // N
    acc = tl.full((BLOCK,), 0.0, tl.float32)
    sq = tl.full((BLOCK,), 0.0, tl.float32)
    for s in tl.static_range(SPLIT_K):  # a fixed order: deterministic
        acc += tl.load(ws_ptr + s * M * N + offs, mask=mask, other=0.0)
        if NORM:
            sq += tl.load(sq_ptr + s * M + m, mask=mask, other=0.0)
    acc = _epilogue(
        acc, sq, offs, offs % N, mask, K, eps, scale_ptr, bias_ptr, res_ptr, HAS_SCALE, HAS_BIAS, NORM, RESIDUAL
    )
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequant_kernel(q_ptr, scale_ptr, out_ptr, numel, K, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    q = tl.load(q_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(scale_ptr + offs // K, mask=mask, other=0.0)
    tl.store(out_ptr + offs, (q * s).to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q * scale[:, None] in float32, rounded once to dtype (as the torch reference, bit for bit),
    in one pass: 1 byte read and 2 written per element (the large-M path: dequantize + cuBLAS)."""
    assert q.dim() == 2 and q.is_contiguous() and q.dtype == torch.float8_e4m3fn
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    if q.numel():
        _dequant_kernel[(triton.cdiv(q.numel(), DEQUANT_BLOCK),)](
            q, scale, out, q.numel(), q.shape[1], BLOCK=DEQUANT_BLOCK, num_warps=4
        )
    return out


@dataclasses.dataclass(frozen=True)
class SkinnyConfig:
    block_m: int  # 1: the GEMV kernel (M = 1, no split)
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


def _pow2_at_least(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(n))


def _fit_shared_memory(bm: int, bn: int, bk: int, weight_bytes: int, x_bytes: int, stages: int) -> int:
    """bk, halved until the weight and x tiles in flight fit in 192 KB of shared memory."""
    while (bn * weight_bytes + bm * x_bytes) * bk * stages > 192 * 1024 and bk > 16:
        bk //= 2
    return bk


def choose_config(M: int, N: int, K: int, sms: int, weight_bytes: int = 1, x_bytes: int = 2) -> SkinnyConfig:
    """Tile sizes by M, then split-K until there are about two programs per SM, while the splits
    divide the K steps evenly (>= 2 steps each) and the fp32 workspace traffic (8 * split * M * N
    bytes) stays within a quarter of the weight's (N * K). The M = 1 and M <= 16 tiles are the
    H200's best (or within 3% of it) over the Qwen3-8B target and drafter shapes, for FP8
    (`weight_bytes` 1) and bf16 (2) weights; wider weights at M <= 16 stream best without split-K,
    in longer K steps. Larger M are first guesses. K steps are shortened where the tiles in flight
    would not fit in shared memory (fp32 `x_bytes` or weights). `python -m blockspec.bench.fp8_bench --sweep` times
    alternatives for FP8 weights."""
    if M == 1:
        wide = N >= 16384  # LM heads, gate|up: longer rows per program, fewer programs
        return SkinnyConfig(1, 32 if wide else 16, min(256 if wide else 512, _pow2_at_least(K)), 1, 8, 3)
    if M <= 16 and weight_bytes > 1:
        bk, stages = (128, 3) if N >= 16384 else (256, 4)
        bn, bk = min(64, _pow2_at_least(N)), min(bk, _pow2_at_least(K))
        return SkinnyConfig(16, bn, _fit_shared_memory(16, bn, bk, weight_bytes, x_bytes, stages), 1, 4, stages)
    if M <= 16:
        bm, bn, bk, warps, stages = 16, 64, 128, 4, 3
    elif M <= 32:
        bm, bn, bk, warps, stages = 32, 64, 256, 4, 4
    elif M <= 64:
        bm, bn, bk, warps, stages = 64, 64, 128, 4, 4
    elif M <= 128 or triton.cdiv(M, 128) * triton.cdiv(N, 128) < sms:
        bm, bn, bk, warps, stages = 64, 128, 128, 4, 3
    else:
        bm, bn, bk, warps, stages = 128, 128, 64, 8, 3
    bm = min(bm, _pow2_at_least(M))
    bn = min(bn, _pow2_at_least(N))
    bk = _fit_shared_memory(bm, bn, min(bk, _pow2_at_least(K)), weight_bytes, x_bytes, stages)
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    k_iters = triton.cdiv(K, bk)
    split = 1
    while (
        tiles * split < 2 * sms
        and k_iters % (2 * split) == 0
        and k_iters // (2 * split) >= 2
        and 32 * (2 * split) * M <= K
    ):
        split *= 2
    return SkinnyConfig(bm, bn, bk, split, warps, stages)


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
    norm: tuple[torch.Tensor, float] | None = None,
    gated: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """residual + prologue(x) @ (weight * scale[:, None]).T + bias. x [..., K] (bf16/fp16/fp32),
    or [..., 2K] gate|up with `gated` (prologue: SiLU(gate) * up, one row only); `norm` (weight [K], eps): the
    prologue is that RMSNorm. weight [N, K] float8_e4m3fn with scale [N] float32, or in x's dtype
    with scale None; bias [N] or None; residual [..., N] like the output, or None. -> [..., N] in
    x's dtype."""
    K = x.shape[-1] // 2 if gated else x.shape[-1]
    N = weight.shape[0]
    assert weight.shape[1] == K, (
        f"x has {x.shape[-1]} features{' (gate|up)' if gated else ''}, weight is {tuple(weight.shape)}"
    )
    assert not gated or x.shape[-1] == 2 * K, f"gate|up of {x.shape[-1]} features: not two halves"
    assert not (gated and norm is not None), "one prologue: norm or gated"
    if scale is None:
        assert weight.dtype == x.dtype, f"an unscaled weight must be in x's dtype {x.dtype}, got {weight.dtype}"
    else:
        assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), x.dtype
    out_shape = (*x.shape[:-1], N)
    x2 = x.reshape(-1, x.shape[-1])
    M = x2.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return y.view(out_shape)
    if residual is not None:
        assert residual.shape == out_shape, f"residual {tuple(residual.shape)} for an output {out_shape}"
        assert residual.dtype == x.dtype, f"a {residual.dtype} residual for {x.dtype} activations"
        residual = residual.contiguous()
    if norm is not None:
        assert norm[0].shape == (K,), f"norm weight {tuple(norm[0].shape)} for {K} features"
    sms = num_sms(x.device, interpreted=8)  # interpreter: few SMs, so that split-K is exercised
    cfg = config or choose_config(M, N, K, sms, weight.element_size(), x.element_size())
    assert not gated or cfg.block_m == 1, "the SwiGLU prologue is the GEMV's only (see layers.linear.fused_linear)"
    # Pointers that a flag leaves unread are given some valid tensor.
    flags = {
        "HAS_SCALE": scale is not None,
        "HAS_BIAS": bias is not None,
        "NORM": norm is not None,
        "RESIDUAL": residual is not None,
    }
    scale = weight if scale is None else scale
    bias = weight if bias is None else bias
    norm_weight, eps = norm if norm is not None else (weight, 0.0)
    residual = weight if residual is None else residual
    if cfg.block_m == 1:
        assert M == 1, f"the GEMV config serves one row, got {M}"
        k_iters = triton.cdiv(K, cfg.block_k)
        _gemv_kernel[(triton.cdiv(N, cfg.block_n),)](
            x2,
            weight,
            scale,
            bias,
            norm_weight,
            residual,
            y,
            N,
            K,
            eps,
            x2.stride(1),
            weight.stride(0),
            weight.stride(1),
            k_iters,
            **flags,
            GATED=gated,
            EVEN_K=K == k_iters * cfg.block_k,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            **pdl_launch(x.device),
        )
        return y.view(out_shape)
    k_iters = triton.cdiv(triton.cdiv(K, cfg.block_k), cfg.split_k)
    split = cfg.split_k > 1
    ws = torch.empty((cfg.split_k, M, N), dtype=torch.float32, device=x.device) if split else y
    sq = torch.empty((cfg.split_k, M), dtype=torch.float32, device=x.device) if split and flags["NORM"] else y
    grid = (triton.cdiv(N, cfg.block_n), triton.cdiv(M, cfg.block_m), cfg.split_k)
    _skinny_kernel[grid](
        x2,
        weight,
        scale,
        bias,
        norm_weight,
        residual,
        y,
        ws,
        sq,
        M,
        N,
        K,
        eps,
        x2.stride(0),
        x2.stride(1),
        weight.stride(0),
        weight.stride(1),
        k_iters,
        **flags,
        SPLIT_K=cfg.split_k,
        EVEN_K=K == cfg.split_k * k_iters * cfg.block_k,
        IEEE=x.dtype == torch.float32,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if split:
        _splitk_reduce_kernel[(triton.cdiv(M * N, REDUCE_BLOCK),)](
            ws,
            sq,
            scale,
            bias,
            residual,
            y,
            M,
            N,
            K,
            eps,
            **flags,
            SPLIT_K=cfg.split_k,
            BLOCK=REDUCE_BLOCK,
            num_warps=4,
        )
    return y.view(out_shape)
