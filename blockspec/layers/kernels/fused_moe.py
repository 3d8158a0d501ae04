"""Fused MoE experts in Triton: `experts_ref` (blockspec.layers.moe) on the device, without a host
synchronisation, so that a step's MoE layers run inside its CUDA graph.

The T * k (row, expert) pairs of a call are grouped by expert on the device (`_align_kernel`, one
launch): each expert's pairs fill BLOCK_M-row blocks of a padded list, its last block topped up
with the sentinel P, and the number of blocks used is written to a device scalar. Two GEMM kernels
then run over a grid (N tiles, the most blocks any routing can fill: `max_blocks`), where the
programs of blocks past the used ones exit at once, so the grid and every buffer depend only on
(T, k, E) and the shapes:
- `_gate_up_kernel`: a block's rows of x (row = pair // k) times its expert's gate|up weight, the
  bias and the activation (SwiGLU or gpt-oss's clamped one) in the epilogue -> h [slots, I]. A
  program's weight rows interleave the gate rows n and up rows I + n of its output columns (as
  `skinny_linear`'s SwiGLU does), so gate and up meet in one accumulator;
- `_down_kernel`: the block's h rows times the expert's down weight, plus its bias, times each
  pair's router weight -> one output row per pair [T * k, H], in x's dtype (as the reference rounds
  each expert's contribution); torch then sums each row's k pairs (deterministic: no atomics).
Both compute acc[BLOCK_N, BLOCK_M] = w_tile @ rows_tile.T ("swap AB", as `skinny_linear`): the
weight rows fill the MMA's wide side and the few rows of a decode step its narrow one. At small T
each touched expert's weights are read once (one block per expert) by programs spread over N,
which is what bounds the step; at prefill the blocks grow to 128 rows (`choose_config`). The tiles
are checked against others by `blockspec.bench.moe_bench --sweep`; loads are by pointers (no TMA)
and launches plain (no PDL).

`fused_moe_triton` also takes the experts' weights in MXFP4 (gpt-oss's checkpoints: FP4 e2m1 values
in groups of 32 sharing an e8m0 scale, `blockspec.layers.mxfp4`), dequantized in registers after the
load, so that a step reads about a quarter of the bytes. Every MXFP4 value is exact in bf16 (one
mantissa bit, float32's exponents), so the MMA sees exactly the dequantized weight."""

import dataclasses

import torch
import triton
import triton.language as tl

from blockspec.layers.kernels import num_sms
from blockspec.layers.kernels.skinny_linear import _output_cols, _weight_rows, load_tile
from blockspec.layers.moe import MoESpec
from blockspec.layers.mxfp4 import GROUP as MXFP4_GROUP

ALIGN_CHUNK = 1024  # ids an align program reads at once
GROUP = tl.constexpr(MXFP4_GROUP)  # values sharing a scale, for the kernels


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    block_m: int  # pair rows a program (16 .. 128); the same for both GEMMs (the blocks are shared)
    block_n: int  # weight rows a program (gate|up: half as many output columns)
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


# block_m -> (block_n, block_k, num_warps, num_stages). Up to 64 rows an expert's GEMM is bound by
# reading its weight: narrow weight tiles in long K steps, deep pipelines; at 128 rows (prefill)
# the square tile of a compute-bound GEMM.
TILES = {16: (64, 128, 4, 4), 32: (64, 128, 4, 4), 64: (64, 128, 4, 3), 128: (128, 64, 8, 3)}


def choose_block_m(pairs: int, experts: int) -> int:
    """The smallest block (16, 32, 64, else 128 rows) holding the pairs an expert gets on average:
    while the GEMMs are bound by reading the weights, an expert's weight is read once per block."""
    return next((bm for bm in (16, 32, 64) if pairs <= bm * experts), 128)


def max_blocks(pairs: int, experts: int, block_m: int) -> int:
    """The most blocks any routing of `pairs` pairs fills: each touched expert (at most
    min(experts, pairs)) pads its last block with fewer than block_m sentinels, and no block is
    all padding. The GEMMs' grids and buffers are sized by it."""
    return min(pairs, (pairs + min(experts, pairs) * (block_m - 1)) // block_m)


def choose_config(pairs: int, experts: int, N: int, K: int, sms: int, elem_bytes: int = 2) -> MoEConfig:
    """Tiles for one GEMM (N weight rows of K) over `pairs` routed pairs: block_m by the rows an
    expert gets, then weight tiles halved (down to 32 rows) until the programs of the blocks a
    small step can fill cover the SMs, so that its few experts' weights stream on all of them.
    float32 (elem_bytes 4) takes K steps half as long (its tiles in registers and shared memory)."""
    bm = choose_block_m(pairs, experts)
    bn, bk, warps, stages = TILES[bm]
    bk = bk // 2 if elem_bytes == 4 else bk
    blocks = max_blocks(pairs, experts, bm)
    while bn > 32 and triton.cdiv(N, bn) * blocks < sms:
        bn //= 2
    return MoEConfig(bm, bn, max(MXFP4_GROUP, min(bk, triton.next_power_of_2(K))), warps, stages)


@triton.jit
def _align_kernel(ids_ptr, pairs_ptr, nblocks_ptr, P, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """Program e: expert e's pairs, in their order, into its blocks of the padded list (the blocks of
    the experts before it first), its last block topped up with P; program 0 also writes how many
    blocks are used. Each program counts every expert's pairs itself (a histogram of the ids)."""
    e = tl.program_id(0)
    counts = tl.zeros((E_PAD,), tl.int32)
    start = P * 0  # (while loops over P: the interpreter cannot range over a runtime argument)
    while start < P:
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < P, other=0).to(tl.int32)
        counts += tl.histogram(ids, E_PAD, mask=offs < P)
        start += CHUNK
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    experts = tl.arange(0, E_PAD)
    base = tl.sum(tl.where(experts < e, blocks, 0)) * BLOCK_M
    count = tl.sum(tl.where(experts == e, counts, 0))
    start, seen = P * 0, P * 0
    while start < P:
        offs = start + tl.arange(0, CHUNK)
        hit = (tl.load(ids_ptr + offs, mask=offs < P, other=-1) == e).to(tl.int32)
        tl.store(pairs_ptr + base + seen + tl.cumsum(hit, 0) - 1, offs, mask=hit != 0)
        seen += tl.sum(hit)
        start += CHUNK
    pad = count + tl.arange(0, BLOCK_M)
    tl.store(pairs_ptr + base + pad, P, mask=pad < tl.cdiv(count, BLOCK_M) * BLOCK_M)
    tl.store(nblocks_ptr, tl.sum(blocks), mask=e == 0)


@triton.jit
def _e2m1(b):
    """Bytes [R, C] of two FP4 (e2m1) values each, low nibble first -> float32 [R, 2C]. The magnitude
    in quarters: 2 * mantissa for exponent 0, else (2 + mantissa) << exponent."""
    b = b.to(tl.int32)
    nib = tl.reshape(tl.join(b & 15, b >> 4), (b.shape[0], 2 * b.shape[1]))
    exponent, mantissa = (nib >> 1) & 3, nib & 1
    quarters = tl.where(exponent == 0, 2 * mantissa, (2 + mantissa) << exponent).to(tl.float32)
    return tl.where(nib >= 8, -quarters, quarters) * 0.25


@triton.jit
def _weight_tile(w_ptr, s_ptr, rows, k0, K, dtype, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, MXFP4: tl.constexpr):
    """Weight rows `rows` (of the experts' stacked [E * N, K]), columns k0 .. k0 + BLOCK_K, in
    `dtype`. MXFP4: w_ptr the bytes [E * N, K / 2], s_ptr the e8m0 scales [E * N, K / 32]; a scale
    s is 2**(s - 127) as the float32 of exponent field s (exact for s in 1..254; 0 reads as 0)."""
    if MXFP4:
        offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        offs_s = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        b = load_tile(w_ptr + rows[:, None] * (K // 2) + offs_b[None, :], offs_b[None, :] < K // 2, EVEN_K)
        s_ptrs = s_ptr + rows[:, None] * (K // GROUP) + offs_s[None, :]
        s = load_tile(s_ptrs, offs_s[None, :] < K // GROUP, EVEN_K)
        scale = (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)
        w = tl.reshape(_e2m1(b), (rows.shape[0], BLOCK_K // GROUP, GROUP)) * scale[:, :, None]
        w = tl.reshape(w, (rows.shape[0], BLOCK_K))
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = load_tile(w_ptr + rows[:, None] * K + offs_k[None, :], offs_k[None, :] < K, EVEN_K)
    return w.to(dtype)


@triton.jit
def _expert_dot(a_ptr, a_rows, w_ptr, s_ptr, w_rows, K: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                IEEE: tl.constexpr, MXFP4: tl.constexpr):  # fmt: skip
    """acc[len(w_rows), len(a_rows)] = w[w_rows] @ a[a_rows].T in float32; a [., K] in the output's
    dtype, w (`_weight_tile`) its stacked rows. Rows are clamped by the caller (loads unmasked)."""
    acc = tl.zeros((w_rows.shape[0], a_rows.shape[0]), tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        a = load_tile(a_ptr + a_rows[:, None] * K + (k0 + offs_k)[None, :], (k0 + offs_k)[None, :] < K, EVEN_K)
        w = _weight_tile(w_ptr, s_ptr, w_rows, k0, K, a.dtype, BLOCK_K, EVEN_K, MXFP4)
        if IEEE:
            acc = tl.dot(w, a.T, acc, input_precision="ieee")
        else:
            acc = tl.dot(w, a.T, acc)
    return acc


@triton.jit
def _activation(acc, alpha, limit, CLAMPED: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] whose rows alternate gate, up -> [BLOCK_N / 2, BLOCK_M]: SiLU(gate) * up,
    or CLAMPED (gpt-oss) gate * sigmoid(alpha * gate) * (up + 1) of gate <= limit, |up| <= limit."""
    gate, up = tl.split(tl.permute(tl.reshape(acc, (acc.shape[0] // 2, 2, acc.shape[1])), (0, 2, 1)))
    if CLAMPED:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        return gate * tl.sigmoid(alpha * gate) * (up + 1)
    return gate * tl.sigmoid(gate) * up


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, s_ptr, bias_ptr, pairs_ptr, nblocks_ptr, ids_ptr, h_ptr, P, alpha, limit,
    H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr,
    EVEN_K: tl.constexpr, IEEE: tl.constexpr, MXFP4: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """h[slots] = activation(x[pairs // k] @ gate_up[expert].T + bias) for one block of pairs and
    BLOCK_N / 2 of the I output columns."""
    pid_n, block = tl.program_id(0), tl.program_id(1)
    used, first = tl.load(nblocks_ptr), tl.load(pairs_ptr + block * BLOCK_M)  # in flight together
    if block >= used:
        return
    expert = tl.load(ids_ptr + first).to(tl.int64)  # a used block's first pair is a real one
    slots = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + slots)
    rows_n = expert * 2 * I + _weight_rows(pid_n, 2 * I, BLOCK_N, True)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rows_n)
    rows_x = tl.where(pairs < P, pairs // TOP_K, 0).to(tl.int64)
    acc = _expert_dot(x_ptr, rows_x, w_ptr, s_ptr, rows_n, H, BLOCK_K, EVEN_K, IEEE, MXFP4)
    if HAS_BIAS:
        acc += bias[:, None].to(tl.float32)
    dtype = h_ptr.dtype.element_ty
    h = _activation(acc.to(dtype).to(tl.float32), alpha, limit, CLAMPED)  # gate|up rounded as F.linear's
    cols, _ = _output_cols(pid_n, 2 * I, BLOCK_N, True)
    tl.store(h_ptr + slots[None, :].to(tl.int64) * I + cols[:, None], h.to(dtype), mask=cols[:, None] < I)


@triton.jit
def _down_kernel(
    h_ptr, w_ptr, s_ptr, bias_ptr, pairs_ptr, nblocks_ptr, ids_ptr, weights_ptr, out_ptr, P,
    H: tl.constexpr, I: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
    MXFP4: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[pairs] = router weight * (h[slots] @ down[expert].T + bias) for one block of pairs and
    BLOCK_N of the H output columns."""
    pid_n, block = tl.program_id(0), tl.program_id(1)
    used, first = tl.load(nblocks_ptr), tl.load(pairs_ptr + block * BLOCK_M)
    if block >= used:
        return
    expert = tl.load(ids_ptr + first).to(tl.int64)
    slots = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + slots)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_n = expert * H + cols % H
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rows_n)
    valid = pairs < P
    router = tl.load(weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
    acc = _expert_dot(h_ptr, slots.to(tl.int64), w_ptr, s_ptr, rows_n, I, BLOCK_K, EVEN_K, IEEE, MXFP4)
    if HAS_BIAS:
        acc += bias[:, None].to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    y = acc.to(dtype).to(tl.float32) * router[None, :]  # rounded as F.linear's output, then weighed
    offs = pairs[None, :].to(tl.int64) * H + cols[:, None]
    tl.store(out_ptr + offs, y.to(dtype), mask=valid[None, :] & (cols[:, None] < H))


def align_pairs(ids: torch.Tensor, experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (the pair indices (row * k + j) grouped by expert in blocks of block_m, each
    expert's last block topped up with T * k: int32 [max_blocks * block_m], of which the blocks used
    come first; how many blocks are used: int32 [1]), on the device, in one launch."""
    P = ids.numel()
    pairs = torch.empty(max_blocks(P, experts, block_m) * block_m, dtype=torch.int32, device=ids.device)
    nblocks = torch.empty(1, dtype=torch.int32, device=ids.device)
    chunk = min(ALIGN_CHUNK, max(triton.next_power_of_2(P), 16))
    e_pad = triton.next_power_of_2(experts)
    _align_kernel[(experts,)](ids, pairs, nblocks, P, E_PAD=e_pad, BLOCK_M=block_m, CHUNK=chunk, num_warps=4)
    return pairs, nblocks


Weight = torch.Tensor | tuple[torch.Tensor, torch.Tensor]  # a weight, or MXFP4's (blocks, scales)


def fused_moe_triton(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: Weight,
    down: Weight,
    gate_up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
    m: MoESpec,
    config: MoEConfig | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """`experts_ref` (blockspec.layers.moe) in two grouped GEMMs, up to rounding (fp32 accumulation):
    x [T, H], weights [T, k] (x's dtype) and ids [T, k] (int64) -> [T, H] in x's dtype. gate_up
    [E, 2I, H] and down [E, H, I] in x's dtype, or both MXFP4 as gpt-oss stores them, each (blocks
    [E, N, K / 32, 16], scales [E, N, K / 32]) uint8, read as `dequantize_mxfp4`'s weights; biases
    [E, 2I] and [E, H] or None; `m` the MoESpec. `config`: both GEMMs' tiles (tests), else
    `choose_config`'s."""
    E, I, H = m.num_experts, m.intermediate_size, x.shape[1]
    assert isinstance(gate_up, tuple) == isinstance(down, tuple), "both projections MXFP4, or neither"
    for w, (N, K) in zip((gate_up, down), ((2 * I, H), (H, I))):
        check_weight(w, (E, N, K), x.dtype)
    gate_up, down = (w if isinstance(w, tuple) else (w,) for w in (gate_up, down))
    return _launch(x, weights, ids, gate_up, down, gate_up_bias, down_bias, m, config, residual)


def check_weight(w: Weight, shape: tuple[int, int, int], dtype: torch.dtype) -> None:
    """w: a weight of `shape` in `dtype`, or the MXFP4 blocks and scales of one."""
    if not isinstance(w, tuple):
        assert w.shape == shape and w.dtype == dtype, f"expert weight {tuple(w.shape)} {w.dtype}: {shape} {dtype}"
        return
    (E, N, K), (blocks, scales) = shape, w
    assert K % MXFP4_GROUP == 0, f"MXFP4 rows of {K} values: not in groups of {MXFP4_GROUP}"
    assert blocks.shape == (E, N, K // MXFP4_GROUP, 16) and scales.shape == (E, N, K // MXFP4_GROUP)
    assert blocks.dtype == scales.dtype == torch.uint8, (blocks.dtype, scales.dtype)


def _launch(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: tuple[torch.Tensor, ...],
    down: tuple[torch.Tensor, ...],
    gate_up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
    m: MoESpec,
    config: MoEConfig | None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """Align the pairs by expert, then the two GEMMs, then each row's sum over its k pairs (plus
    `residual` [T, H] where given, in the same launch). gate_up and down: (weight,) or MXFP4's
    (blocks, scales)."""
    (T, H), k = x.shape, ids.shape[1]
    E, I, P = m.num_experts, m.intermediate_size, x.shape[0] * ids.shape[1]
    assert weights.shape == ids.shape and ids.shape[0] == T and ids.dtype == torch.int64
    if P == 0:
        return torch.zeros_like(x) if residual is None else residual.clone()
    mxfp4 = len(gate_up) == 2
    # Pointers that a flag leaves unread (scales, biases) are given some valid tensor: without MXFP4
    # the scales are the weight.
    x, weights, ids = x.contiguous(), weights.contiguous(), ids.contiguous()
    w1, s1, w2, s2 = (t.contiguous() for t in (gate_up[0], gate_up[-1], down[0], down[-1]))
    b1, b2 = (w if b is None else b.contiguous() for w, b in ((w1, gate_up_bias), (w2, down_bias)))
    sms = num_sms(x.device, interpreted=8)
    cfg1 = config or choose_config(P, E, 2 * I, H, sms, x.element_size())
    cfg2 = config or choose_config(P, E, H, I, sms, x.element_size())
    bm, blocks = cfg1.block_m, max_blocks(P, E, cfg1.block_m)
    pairs, nblocks = align_pairs(ids, E, bm)
    common = {"IEEE": x.dtype == torch.float32, "MXFP4": mxfp4, "BLOCK_M": bm}
    h = torch.empty(blocks * bm, I, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(triton.cdiv(2 * I, cfg1.block_n), blocks)](
        x, w1, s1, b1, pairs, nblocks, ids, h, P,
        m.swiglu_alpha, m.swiglu_limit, H=H, I=I, TOP_K=k, HAS_BIAS=gate_up_bias is not None,
        CLAMPED=m.activation == "clamped_swiglu", EVEN_K=H % cfg1.block_k == 0, **common,
        BLOCK_N=cfg1.block_n, BLOCK_K=cfg1.block_k, num_warps=cfg1.num_warps, num_stages=cfg1.num_stages,
    )  # fmt: skip
    out = torch.empty(P, H, dtype=x.dtype, device=x.device)
    _down_kernel[(triton.cdiv(H, cfg2.block_n), blocks)](
        h, w2, s2, b2, pairs, nblocks, ids, weights, out, P,
        H=H, I=I, HAS_BIAS=down_bias is not None, EVEN_K=I % cfg2.block_k == 0, **common,
        BLOCK_N=cfg2.block_n, BLOCK_K=cfg2.block_k, num_warps=cfg2.num_warps, num_stages=cfg2.num_stages,
    )  # fmt: skip
    if residual is not None:
        return _add_pair_sums(residual, out.view(T, k, H))
    return out.view(T, k, H).sum(1) if k > 1 else out


@torch.compile(dynamic=True)
def _add_pair_sums(residual: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """residual [T, H] + pairs [T, k, H] summed over k: one fused launch (eager: a sum, then an add)."""
    return residual + pairs.sum(1)
