"""Skinny linear in Triton: y = residual + norm(x) @ w.T + bias for the few rows of a decode,
verify or propose step. Two entry points share the kernels:
- `skinny_linear` (through `blockspec.layers.linear.linear`): x and w in bf16/fp16 (or fp32, with
  exact fp32 products), up to `linear.skinny_max_rows` rows, where it reads the weight faster than cuBLAS
  (`python -m blockspec.bench.fp8_bench` times the drafter's shapes, column "linear µs");
- `skinny_scaled_mm` (through `blockspec.layers.quantization.Fp8Linear`), W8A8: x and w in
  float8_e4m3fn, each with one float32 scale per row, multiplied on FP8 tensor cores; the scales
  commute with the K reduction, so both are applied once to the fp32 accumulator in the epilogue.
  (Not weight-only, bf16 x and the FP8 weight converted in registers: the conversion slows it.)
Accumulation is fp32. At small M the GEMM is bound by reading the weight, so both kernels only
stream it, and the small elementwise ops around a decoder layer's GEMMs ride along instead of
costing a launch and a round trip each (W8A8 gets its norm from `quantize_rows` instead):
- prologue RMSNorm (qkv and gate|up): the squares of each x tile are summed as it is read, and
  the norm weight multiplies the x tile (GEMV) or the weight tile (MMA: the weight is the register
  operand, so x reaches the MMA as loaded); the row's 1 / rms is a per-row factor, applied to the
  accumulator at the end (the normed x is never stored); a norm whose weight is folded into w
  (`CausalLM.fold_norms`) only sums the squares;
- epilogue SwiGLU (gate|up): a program's weight rows interleave the gate rows n and the up rows
  I + n of its output columns, so gate and up meet in one accumulator tile (as tuned for a plain
  GEMM) and it writes SiLU(gate) * up, each rounded to the activation dtype first as the unfused
  GEMM stores them (no split-K: gate and up must meet in one program). Not down_proj's prologue:
  there the computed tile has to go back to shared memory as the MMA's operand, and at one row
  each program would recompute it from all of gate|up. Not two accumulators (a gate and an up tile
  per program, at the plain GEMM's tiles): slower;
- epilogue residual add (o and down): the output is the residual stream itself.

M = 1, `_gemv_kernel`: a program owns BLOCK_N rows of w and walks K, multiply-adding on the CUDA
cores into an fp32 [BLOCK_N, BLOCK_K] tile summed once at the end (no MMA: with one row it would
waste 15/16 of its lanes and add a layout shuffle per tile). It is launched with programmatic
dependent launch (`blockspec.layers.kernels.pdl`).

M > 1 (and W8A8 at any M), `_skinny_kernel`, "swap AB": a program computes the transposed tile
acc[BLOCK_N, BLOCK_M] = w_tile @ x_tile.T, so the weight rows fill the MMA's large M side (64, the
wgmma granule on Hopper) and the few activation rows the narrow side (>= 16 for tl.dot; rows past
M are clamped, not masked, and the store is masked). Its tiles load by TMA, from tensor descriptors
made on the host (`_tma_sources`), wherever the tile rows are 16-byte aligned and not SwiGLU's
interleaved rows (two boxes, a gate and an up tile, were slower than pointers); else by pointers.
It launches with programmatic dependent launch, letting the next kernel in after its K loop
(`blockspec.layers.kernels.pdl`).

Split-K: when the (M, N) tiles are too few to keep the SMs streaming (N = 1024..4096 at small M),
the K range is cut into SPLIT_K chunks handled by separate programs, each writing an fp32 partial
tile to a workspace; a second kernel sums the partials in a fixed order (deterministic, no
atomics) and applies the per-row factor (1 / rms from the splits' sums of squares, or x's scale),
w's scale, bias, residual and cast (summing them in the last split to arrive, as the attention
does, saves that launch but no time here). Launch shapes depend only on (M, N, K), there is no host
synchronisation, and the workspace comes from the caching allocator, so calls can be captured in
CUDA graphs (warm up first: the first call compiles).

`dequantize_fp8` serves Fp8Linear's reference path on CUDA: one pass, float32 product rounded
once, equal bit for bit to the torch reference."""

import dataclasses

import torch
import triton
import triton.language as tl

from blockspec.layers.kernels import is_hopper_or_later, num_sms
from blockspec.layers.kernels.pdl import await_previous_kernel, let_next_kernel_in, pdl_launch, wait_previous_kernel

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # an older triton: tiles load by pointers
    TensorDescriptor = None

REDUCE_BLOCK = 1024
DEQUANT_BLOCK = 4096


@triton.jit
def load_tile(ptrs, mask, EVEN: tl.constexpr):
    """A tile, its mask skipped on even shapes."""
    if EVEN:
        v = tl.load(ptrs)
    else:
        v = tl.load(ptrs, mask=mask, other=0.0)
    return v


@triton.jit
def _weight_rows(pid_n, N, BLOCK_N: tl.constexpr, SWIGLU: tl.constexpr):
    """The weight rows of tile pid_n, clamped into range (loads stay in bounds, the store is
    masked). SWIGLU (a gate|up weight of N = 2I rows): row j of the tile is the gate (even j) or
    up (odd j) row of output column pid_n * BLOCK_N / 2 + j // 2."""
    j = tl.arange(0, BLOCK_N)
    if SWIGLU:
        col = (pid_n * (BLOCK_N // 2) + j // 2) % (N // 2)
        rows = col + (j % 2) * (N // 2)
    else:
        rows = (pid_n * BLOCK_N + j) % N
    return rows.to(tl.int64)  # N * K may pass 2**31 (LM heads)


@triton.jit
def _output_cols(pid_n, N, BLOCK_N: tl.constexpr, SWIGLU: tl.constexpr):
    """(tile pid_n's output columns, the output's width): BLOCK_N of N, or with SWIGLU BLOCK_N / 2
    of N / 2."""
    if SWIGLU:
        cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        width = N // 2
    else:
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        width = N
    return cols, width


@triton.jit
def _swiglu(y, dtype):
    """SiLU(gate) * up of y [BLOCK_N, ...] whose rows alternate gate, up (`_weight_rows`) ->
    [BLOCK_N / 2, ...]; gate and up rounded to `dtype` first, as the unfused GEMM stores them."""
    y = y.to(dtype).to(tl.float32)
    if len(y.shape) == 1:
        gate, up = tl.split(tl.reshape(y, (y.shape[0] // 2, 2)))
    else:
        gate, up = tl.split(tl.permute(tl.reshape(y, (y.shape[0] // 2, 2, y.shape[1])), (0, 2, 1)))
    return gate * tl.sigmoid(gate) * up


@triton.jit
def _row_factor(sq, m, K, eps, x_scale_ptr, NORM, FP8):
    """The accumulator's factor per row of x: 1 / rms (from the row's sum of squares `sq`) with the
    norm prologue, the row's scale with FP8 x (`m`: clamped row indices), else 1."""
    factor = 1.0
    if NORM:
        factor = tl.rsqrt(sq / K + eps)
    elif FP8:
        factor = tl.load(x_scale_ptr + m)
    return factor


@triton.jit
def _epilogue_operands(offs, n, mask, w_scale_ptr, bias_ptr, res_ptr, FP8, HAS_BIAS, RESIDUAL):
    """(w_scale[n], bias[n], residual[offs]), each read only where its flag is on. `n`: the weight
    rows of the accumulator's rows, clamped into range (read unmasked; what is past the output is
    never stored). The MMA kernel reads them before its K loop, so that their latency hides behind
    it instead of adding a round trip to every program's tail."""
    w_scale, bias, res = 1.0, 0.0, 0.0
    if FP8:
        w_scale = tl.load(w_scale_ptr + n)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + n)
    if RESIDUAL:
        res = tl.load(res_ptr + offs, mask=mask, other=0.0)
    return w_scale, bias, res


@triton.jit
def _epilogue(acc, row_factor, w_scale, bias, res, FP8, HAS_BIAS, RESIDUAL):
    """acc * row_factor * w_scale + bias + residual (`_epilogue_operands`)."""
    acc = acc * row_factor
    if FP8:
        acc = acc * w_scale
    if HAS_BIAS:
        acc += bias.to(tl.float32)
    if RESIDUAL:
        acc += res.to(tl.float32)
    return acc


@triton.jit
def _skinny_kernel(
    x_src, w_src, x_scale_ptr, w_scale_ptr, bias_ptr, norm_ptr, res_ptr, y_ptr, ws_ptr, sq_ptr,
    M, N, K, eps, stride_xm, stride_xk, stride_wn, stride_wk,
    K_ITERS: tl.constexpr,  # BLOCK_K steps per split (constexpr: a known trip count)
    HAS_BIAS: tl.constexpr, NORM: tl.constexpr, NORM_WEIGHT: tl.constexpr, RESIDUAL: tl.constexpr,
    FP8: tl.constexpr, SWIGLU: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
    TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # x_src, w_src: tensor descriptors of x [M, K] and w [N, K] with TMA, else their pointers.
    wait_previous_kernel(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_k * K_ITERS * BLOCK_K + tl.arange(0, BLOCK_K)
    rows_n = _weight_rows(pid_n, N, BLOCK_N, SWIGLU)
    rows_m = offs_m % M  # clamped as rows_n
    if not TMA:
        w_ptrs = w_src + rows_n[:, None] * stride_wn + offs_k[None, :] * stride_wk  # [BLOCK_N, BLOCK_K]
        x_ptrs = x_src + rows_m[None, :] * stride_xm + offs_k[:, None] * stride_xk  # [BLOCK_K, BLOCK_M]
    cols, width = _output_cols(pid_n, N, BLOCK_N, SWIGLU)
    mask = (cols[:, None] < width) & (offs_m[None, :] < M)
    offs = offs_m[None, :] * width + cols[:, None]  # y, the residual and each workspace slice: [M, width]
    if SPLIT_K == 1:  # else the reduce kernel applies them
        w_scale, bias, res = _epilogue_operands(
            offs, rows_n[:, None], mask, w_scale_ptr, bias_ptr, res_ptr, FP8, HAS_BIAS, RESIDUAL
        )
    acc = tl.full((BLOCK_N, BLOCK_M), 0.0, tl.float32)
    sq = tl.full((BLOCK_M,), 0.0, tl.float32)
    for i in range(K_ITERS):
        if TMA:  # boxes past the tensor's edges read as zeros: no clamps, no masks
            k = (pid_k * K_ITERS + i) * BLOCK_K
            w = w_src.load([pid_n * BLOCK_N, k])
            x = x_src.load([pid_m * BLOCK_M, k]).T
        else:
            w = load_tile(w_ptrs, offs_k[None, :] < K, EVEN_K)
            x = load_tile(x_ptrs, offs_k[:, None] < K, EVEN_K)
            w_ptrs += BLOCK_K * stride_wk
            x_ptrs += BLOCK_K * stride_xk
        if NORM_WEIGHT:  # the norm weight scales the weight tile, the register operand: x stays as loaded
            g = load_tile(norm_ptr + offs_k, offs_k < K, EVEN_K).to(tl.float32)
            w = (w.to(tl.float32) * g[None, :]).to(x.dtype)
        if NORM:
            sq += tl.sum(x.to(tl.float32) * x.to(tl.float32), axis=0)
        if FP8:  # Hopper's FP8 MMAs add with ~14 bits: each K step's sum joins the fp32 total apart
            acc += tl.dot(w, x)
        elif IEEE:
            acc = tl.dot(w, x, acc, input_precision="ieee")
        else:
            acc = tl.dot(w, x, acc)
        offs_k += BLOCK_K
    let_next_kernel_in(PDL)
    if SPLIT_K == 1:
        factor = _row_factor(sq[None, :], rows_m[None, :], K, eps, x_scale_ptr, NORM, FP8)
        acc = _epilogue(acc, factor, w_scale, bias, res, FP8, HAS_BIAS, RESIDUAL)
        if SWIGLU:
            acc = _swiglu(acc, y_ptr.dtype.element_ty)
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:  # partial sums to the workspace [SPLIT_K, M, N]; sums of squares [SPLIT_K, M], once per row
        tl.static_assert(not SWIGLU, "SwiGLU's gate and up meet in one program: no split-K")
        tl.store(ws_ptr + pid_k * M * N + offs, acc, mask=mask)
        if NORM:
            tl.store(sq_ptr + pid_k * M + offs_m, sq, mask=(offs_m < M) & (pid_n == 0))


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, bias_ptr, norm_ptr, res_ptr, y_ptr, N, K, eps, stride_xk, stride_wn, stride_wk,
    K_ITERS: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, NORM_WEIGHT: tl.constexpr, SWIGLU: tl.constexpr,
    RESIDUAL: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows_n = _weight_rows(tl.program_id(0), N, BLOCK_N, SWIGLU)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows_n[:, None] * stride_wn + offs_k[None, :] * stride_wk
    acc = tl.full((BLOCK_N, BLOCK_K), 0.0, tl.float32)
    sq = tl.full((BLOCK_K,), 0.0, tl.float32)
    await_previous_kernel(PDL)
    for _ in range(K_ITERS):
        w = load_tile(w_ptrs, offs_k[None, :] < K, EVEN_K)
        x = load_tile(x_ptr + offs_k * stride_xk, offs_k < K, EVEN_K).to(tl.float32)
        if NORM:
            sq += x * x
        if NORM_WEIGHT:
            x = x * load_tile(norm_ptr + offs_k, offs_k < K, EVEN_K).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
        w_ptrs += BLOCK_K * stride_wk
        offs_k += BLOCK_K
    cols, width = _output_cols(tl.program_id(0), N, BLOCK_N, SWIGLU)
    # Read after the loop here: before it, they cost registers enough to halve the programs an SM
    # (o_proj's tile: 128 -> 160 a thread at 8 warps, sm_90).
    w_scale, bias, res = _epilogue_operands(
        cols, rows_n, cols < width, y_ptr, bias_ptr, res_ptr, False, HAS_BIAS, RESIDUAL
    )
    factor = _row_factor(tl.sum(sq), 0, K, eps, y_ptr, NORM, False)
    y = _epilogue(tl.sum(acc, axis=1), factor, w_scale, bias, res, False, HAS_BIAS, RESIDUAL)
    if SWIGLU:
        y = _swiglu(y, y_ptr.dtype.element_ty)
    tl.store(y_ptr + cols, y.to(y_ptr.dtype.element_ty), mask=cols < width)


@triton.jit
def _splitk_reduce_kernel(
    ws_ptr, sq_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, res_ptr, y_ptr, M, N, K, eps,
    HAS_BIAS: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr, FP8: tl.constexpr,
    SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    await_previous_kernel(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    m = tl.minimum(offs // N, M - 1)  # clamped: the row scales are read unmasked
    w_scale, bias, res = _epilogue_operands(
        offs, offs % N, mask, w_scale_ptr, bias_ptr, res_ptr, FP8, HAS_BIAS, RESIDUAL
    )
    acc = tl.full((BLOCK,), 0.0, tl.float32)
    sq = tl.full((BLOCK,), 0.0, tl.float32)
    for s in tl.static_range(SPLIT_K):  # a fixed order: deterministic
        acc += tl.load(ws_ptr + s * M * N + offs, mask=mask, other=0.0)
        if NORM:
            sq += tl.load(sq_ptr + s * M + m, mask=mask, other=0.0)
    factor = _row_factor(sq, m, K, eps, x_scale_ptr, NORM, FP8)
    acc = _epilogue(acc, factor, w_scale, bias, res, FP8, HAS_BIAS, RESIDUAL)
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
    in one pass: 1 byte read and 2 written per element."""
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


def _tma_sources(x: torch.Tensor, w: torch.Tensor, cfg: SkinnyConfig, swiglu: bool) -> tuple | None:
    """Tensor descriptors of x's [block_m, block_k] and w's [block_n, block_k] tiles, or None where TMA
    cannot load them: before Hopper (or an older triton), rows or a base not 16-byte aligned, or
    SwiGLU (a tile's weight rows interleave gate and up rows, no box). Triton's interpreter runs
    descriptors too, so the CPU tests take this path."""
    if swiglu or TensorDescriptor is None:
        return None
    if x.device.type == "cuda" and not is_hopper_or_later(x.device.index):
        return None
    if any(t.stride(1) != 1 or t.stride(0) * t.element_size() % 16 or t.data_ptr() % 16 for t in (x, w)):
        return None
    return (
        TensorDescriptor.from_tensor(x, [cfg.block_m, cfg.block_k]),
        TensorDescriptor.from_tensor(w, [cfg.block_n, cfg.block_k]),
    )


def _pow2_at_least(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(n))


def _fit_shared_memory(bm: int, bn: int, bk: int, elem_bytes: int, stages: int, min_bk: int) -> int:
    """bk, halved until the weight and x tiles in flight fit in 192 KB of shared memory."""
    while (bn + bm) * elem_bytes * bk * stages > 192 * 1024 and bk > min_bk:
        bk //= 2
    return bk


def _split_k(tiles: int, k_iters: int, M: int, K: int, min_programs: int) -> int:
    """Splits of K, doubled while there are fewer than `min_programs` programs, the splits divide the
    K steps evenly (>= 2 steps each) and the fp32 workspace traffic (8 * split * M * N bytes) stays
    within a quarter of the weight's (N * K)."""
    split = 1
    while (
        tiles * split < min_programs
        and k_iters % (2 * split) == 0
        and k_iters // (2 * split) >= 2
        and 32 * (2 * split) * M <= K
    ):
        split *= 2
    return split


# The GEMV's (block_n, block_k, num_warps, num_stages) by its prologue: "norm" (an RMSNorm), "rms"
# (one whose weight is folded into w: 1 / rms only) or None; for weights narrower than WIDE_N and
# wider. The best tile moves with the fused ops (their registers and loads), so each has its own,
# tuned on the H200 over Qwen3-8B's shapes at one row.
GEMV_TILES = {"norm": (16, 512, 4, 3), "rms": (8, 512, 4, 3), None: (16, 1024, 8, 2)}
GEMV_WIDE_TILES = {"norm": (64, 128, 4, 3), "rms": (32, 128, 4, 3), None: (32, 256, 8, 3)}
WIDE_N = 16384  # LM heads, gate|up: longer rows per program, fewer programs (GEMV and MMA tiles)


def choose_config(M: int, N: int, K: int, sms: int, elem_bytes: int = 2, prologue: str | None = None) -> SkinnyConfig:
    """Tile sizes by M and the bytes of an x or weight element (1: W8A8), then split-K; at one row
    (the GEMV) also by the `prologue` fused in ("norm", "rms" or None). The M = 1 and M <= 16
    tiles are the H200's best (or within 3% of it) over the Qwen3-8B target's shapes in bf16 and
    the drafter's in W8A8: wide weights stream best in long K steps, bf16 ones without split-K, FP8
    ones split until half the SMs have a program (down_proj, o_proj); larger M are first guesses,
    split until about two programs per SM. K steps are shortened where the tiles in flight would
    not fit in shared memory (fp32). `python -m blockspec.bench.fp8_bench --sweep` times
    alternatives for W8A8."""
    if M == 1 and elem_bytes > 1:  # W8A8 runs on the MMA kernel at any M
        bn, bk, warps, stages = (GEMV_WIDE_TILES if N >= WIDE_N else GEMV_TILES)[prologue]
        return SkinnyConfig(1, bn, min(bk, _pow2_at_least(K)), 1, warps, stages)
    if M <= 16:
        wide = N >= WIDE_N
        bm, bn, bk, warps, stages = 16, 64, 128 if wide and elem_bytes > 1 else 256, 4, 3 if wide else 4
        min_programs = sms // 2 if elem_bytes == 1 else 1
    elif M <= 32:
        bm, bn, bk, warps, stages, min_programs = 32, 64, 256, 4, 4, 2 * sms
    elif M <= 64:
        bm, bn, bk, warps, stages, min_programs = 64, 64, 128, 4, 4, 2 * sms
    elif M <= 128 or triton.cdiv(M, 128) * triton.cdiv(N, 128) < sms:
        bm, bn, bk, warps, stages, min_programs = 64, 128, 128, 4, 3, 2 * sms
    else:
        bm, bn, bk, warps, stages, min_programs = 128, 128, 64, 8, 3, 2 * sms
    min_bk = 32 if elem_bytes == 1 else 16  # FP8 MMAs take K in steps of 32
    bm = min(bm, _pow2_at_least(M))
    bn = min(bn, _pow2_at_least(N))
    bk = _fit_shared_memory(bm, bn, min(bk, _pow2_at_least(K, min_bk)), elem_bytes, stages, min_bk)
    split = _split_k(triton.cdiv(M, bm) * triton.cdiv(N, bn), triton.cdiv(K, bk), M, K, min_programs)
    return SkinnyConfig(bm, bn, bk, split, warps, stages)


def invariant_split_k(N: int, K: int) -> int:
    """Row invariance's split of K for a weight [N, K], the same at every row count: in two halves
    where K is long beside N (K >= 2N: down_proj), at a multiple of 256 so that every tile's K
    steps end on it, else none: there the halves keep more programs streaming at 129-256 rows and
    cost nothing at 1-16; where K = N (o_proj, qkv) a split is slower at 256 rows (docs/design.md)."""
    return 2 if K >= 2 * N and K % 512 == 0 else 1


def invariant_config(M: int, N: int, K: int, sms: int) -> SkinnyConfig:
    """`choose_config`'s MMA tiles for M rows (at one row too: no GEMV) with a fixed split of K
    (`invariant_split_k`), for row invariance (`blockspec.layers.row_invariant`): each output then
    sums its K products in one order, BLOCK_K steps of the same MMA accumulated in place over each
    split, the splits summed in order, whatever the tiles or the row count. From 129 to 256 rows
    (16 sequences' 16-row verify), the H200's best of a sweep over Qwen3-8B's shapes at 256 rows:
    wide weights in 256-row tiles; others in 64 weight rows a tile where that makes one wave of
    programs, else 128 (qkv 42%, o 20%, gate|up 7% faster than `choose_config`'s tiles), a split
    weight in 128 (the H100's best of a sweep at down_proj's shape). At one row, from the same sweep, a wide weight streams best in
    128 weight rows a tile with five K steps in flight; from 2 to 16 rows the 16-row tiles stay best."""
    split = invariant_split_k(N, K)
    if M == 1 and N >= WIDE_N:
        return SkinnyConfig(16, 128, 128, split, 4, 5)
    if M <= 128 or M > 256:
        return dataclasses.replace(choose_config(max(M, 2), N, K, sms), split_k=split)
    if N >= WIDE_N:
        return SkinnyConfig(256, 128, 64, split, 8, 4)
    if split == 1 and triton.cdiv(M, 128) * triton.cdiv(N, 64) <= sms:
        return SkinnyConfig(128, 64, 128, 1, 4, 3)
    return SkinnyConfig(128, 128, 64, split, 4, 4)


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
    norm: tuple[torch.Tensor, float] | None = None,
    swiglu: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """residual + norm(x) @ weight.T + bias. x [..., K] (bf16/fp16/fp32); `norm` (weight [K] or
    None: folded into `weight`, eps): the prologue is that RMSNorm. weight [N, K] in x's dtype;
    bias [N] or None; residual [..., N] like the output, or None. -> [..., N] in x's dtype; with
    `swiglu` (weight gate|up of 2I rows, no residual) -> [..., I], SiLU(gate) * up."""
    assert weight.shape[1] == x.shape[-1], f"x has {x.shape[-1]} features, weight is {tuple(weight.shape)}"
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), x.dtype
    assert weight.dtype == x.dtype, f"the weight must be in x's dtype {x.dtype}, got {weight.dtype}"
    if norm is not None and norm[0] is not None:
        assert norm[0].shape == (x.shape[-1],), f"norm weight {tuple(norm[0].shape)} for {x.shape[-1]} features"
    return _launch(x, weight, x.dtype, bias, config, norm, swiglu, residual, None)


def skinny_scaled_mm(
    qx: torch.Tensor,
    x_scale: torch.Tensor,
    qw: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
    swiglu: bool = False,
) -> torch.Tensor:
    """W8A8: residual + (qx * x_scale) @ (qw * w_scale[:, None]).T + bias on FP8 tensor cores, for
    few rows of x. qx [..., K] and qw [N, K] float8_e4m3fn; x_scale one float32 per row of qx ([M]
    or [M, 1], from `quantize_rows`, which also applies the layer's norm); w_scale [N] float32.
    -> [..., N] in out_dtype (bf16/fp16/fp32); bias and residual in it too. `swiglu` as in
    `skinny_linear`."""
    assert qx.dtype == qw.dtype == torch.float8_e4m3fn, f"FP8 x and weight expected, got {qx.dtype}, {qw.dtype}"
    assert qw.shape[1] == qx.shape[-1], f"x has {qx.shape[-1]} features, weight is {tuple(qw.shape)}"
    assert x_scale.dtype == w_scale.dtype == torch.float32 and w_scale.shape == (qw.shape[0],)
    assert x_scale.numel() == qx.numel() // max(qx.shape[-1], 1), f"{x_scale.numel()} row scales for x {qx.shape}"
    assert out_dtype in (torch.bfloat16, torch.float16, torch.float32), out_dtype
    scales = (x_scale.reshape(-1).contiguous(), w_scale)
    return _launch(qx, qw, out_dtype, bias, config, None, swiglu, residual, scales)


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    config: SkinnyConfig | None,
    norm: tuple[torch.Tensor, float] | None,
    swiglu: bool,
    residual: torch.Tensor | None,
    scales: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    K, N = weight.shape[1], weight.shape[0]
    assert not swiglu or (N % 2 == 0 and residual is None), f"SwiGLU of {N} gate|up rows (even, no residual)"
    out_shape = (*x.shape[:-1], N // 2 if swiglu else N)
    x2 = x.reshape(-1, x.shape[-1])
    M = x2.shape[0]
    y = torch.empty((M, out_shape[-1]), dtype=out_dtype, device=x.device)
    if M == 0:
        return y.view(out_shape)
    if residual is not None:
        assert residual.shape == out_shape, f"residual {tuple(residual.shape)} for an output {out_shape}"
        assert residual.dtype == out_dtype, f"a {residual.dtype} residual for a {out_dtype} output"
        residual = residual.contiguous()
    sms = num_sms(x.device, interpreted=8)  # interpreter: few SMs, so that split-K is exercised
    prologue = None if norm is None else "norm" if norm[0] is not None else "rms"
    cfg = config or choose_config(M, N, K, sms, x.element_size(), prologue)
    if swiglu:  # gate and up meet in one program's epilogue
        cfg = dataclasses.replace(cfg, split_k=1)
    assert not (scales is not None and cfg.block_m == 1), "W8A8 runs on the MMA kernel"
    # Pointers that a flag leaves unread are given some valid tensor.
    norm_weight, eps = norm if norm is not None else (None, 0.0)
    flags = {"HAS_BIAS": bias is not None, "NORM": norm is not None, "RESIDUAL": residual is not None}
    fused = {**flags, "NORM_WEIGHT": norm_weight is not None, "SWIGLU": swiglu}  # the GEMM kernels' flags
    bias = weight if bias is None else bias
    norm_weight = weight if norm_weight is None else norm_weight
    residual = weight if residual is None else residual
    pdl = pdl_launch(x.device)
    if cfg.block_m == 1:
        assert M == 1, f"the GEMV config serves one row, got {M}"
        k_iters = triton.cdiv(K, cfg.block_k)
        _gemv_kernel[(triton.cdiv(N, cfg.block_n),)](
            x2, weight, bias, norm_weight, residual, y, N, K, eps, x2.stride(1), weight.stride(0), weight.stride(1),
            k_iters, **fused, EVEN_K=K == k_iters * cfg.block_k, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl,
        )  # fmt: skip
        return y.view(out_shape)
    x_scale, w_scale = scales if scales is not None else (weight, weight)
    k_iters = triton.cdiv(triton.cdiv(K, cfg.block_k), cfg.split_k)
    split = cfg.split_k > 1
    ws = torch.empty((cfg.split_k, M, N), dtype=torch.float32, device=x.device) if split else y
    sq = torch.empty((cfg.split_k, M), dtype=torch.float32, device=x.device) if split and flags["NORM"] else y
    grid = (triton.cdiv(N, cfg.block_n), triton.cdiv(M, cfg.block_m), cfg.split_k)
    descriptors = _tma_sources(x2, weight, cfg, swiglu)
    x_src, w_src = descriptors or (x2, weight)
    _skinny_kernel[grid](
        x_src, w_src, x_scale, w_scale, bias, norm_weight, residual, y, ws, sq, M, N, K, eps,
        x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1), k_iters, **fused,
        FP8=scales is not None, SPLIT_K=cfg.split_k, EVEN_K=K == cfg.split_k * k_iters * cfg.block_k,
        IEEE=x.dtype == torch.float32, TMA=descriptors is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl,
    )  # fmt: skip
    if split:
        _splitk_reduce_kernel[(triton.cdiv(M * N, REDUCE_BLOCK),)](
            ws, sq, x_scale, w_scale, bias, residual, y, M, N, K, eps, **flags, FP8=scales is not None,
            SPLIT_K=cfg.split_k, BLOCK=REDUCE_BLOCK, num_warps=4, **pdl,
        )  # fmt: skip
    return y.view(out_shape)
