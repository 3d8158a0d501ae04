"""Paged attention in Triton: the CUDA implementation of `paged_attention` (same contract as
`blockspec.layers.attention.paged_attention_ref`).

One program handles one (sequence b, kv head, tile of query rows[, key split]). Its query rows
are the S*G (row, head) pairs of that kv head, flattened as r = s*G + g (query head
kv_head*G + g), so GQA heads share every K/V load; a tile holds up to 64 rows (padded to a power
of two, at least 16 for tl.dot), so decode/verify (S <= 16) is one tile and long prefills use
several (the fused step launch may cut a verify's rows into tiles of 16: `step_grid`). The
program streams the keys of [min k_start, max k_end) over its rows in tiles of BLOCK_N
positions: position k lives in slot block_tables[b, k // page_size] * page_size + k % page_size,
looked up per key (pages need not be contiguous, and page_size need not divide BLOCK_N).
Online softmax in fp32 (exp2, scale folded into log2 e), per-row masks from k_start/k_end.

Split-K (flash-decoding): when there are too few programs to fill the GPU (small batch, long
context) the key range of each program is cut into `num_splits` chunks handled by separate
programs, each writing a normalized partial output and its log-sum-exp (zeros and -inf where it
holds none of a row's keys, so that the combine's loads need not wait for the log-sum-exps to
know which partials exist); with up to ARRIVE_MAX_SPLITS splits the last split of a tile to finish combines them (each counts
its arrival on a per-tile counter, which the last resets for the next launch), else a second
kernel does. The chunk boundaries are computed inside the kernel from the actual key range,
so the launch grid depends only on shapes (B, S, M, Hkv): the call has no host sync and can be
captured in a CUDA graph. Every kernel here (the one-launch step kernel `qkv_attention_triton`,
the attention of `paged_attention_triton` and the combine) launches with programmatic dependent
launch (`blockspec.layers.kernels.pdl`).

Attention sinks (gpt-oss, HAS_SINKS): a logit per query head that joins each row's softmax as one
more column of value zero, so out = acc / (l + 2^(sink - m)) in the log2 domain (sink * log2 e),
where the row's keys gave the running max m and sum l. It is added once, where a row's output is
made: unsplit in `_finish`; split, never to a partial (a partial's lse must stay its keys' alone
for the combine's weights) but in the combine, as one more term of its max and denominator.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from blockspec.layers.kernels import num_sms
from blockspec.layers.kernels.pdl import await_previous_kernel, let_next_kernel_in, pdl_launch, wait_previous_kernel
from blockspec.layers.kernels.qk_norm_rope import rms_norm_halves, rotate_halves

LOG2E = 1.4426950408889634
MAX_ROWS = 64  # query rows per program
MIN_KEYS_PER_SPLIT = 64  # a bf16 key tile at head_dim <= 128: one tile a split beats two
MAX_SPLITS = 32
_LOG2E = tl.constexpr(LOG2E)  # the kernels' copy (a jit function reads only constexpr globals)


@triton.jit
def _softmax_step(qk, visible, m_i, l_i, acc, v, PRECISION: tl.constexpr):
    """One tile of keys into the running softmax of each row (log2 domain, qk already scaled):
    its max m_i, sum l_i and output acc."""
    qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
    p = tl.exp2(qk - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend_cache(
    q, m_i, l_i, acc, k_ptr, v_ptr, table, kv_head, start, end, k_start, k_end,
    stride_kn, stride_kh, stride_vn, stride_vh, stride_tm, qk_scale, d, d_ok,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The cached keys at positions [start, end) of one kv head into the running softmax; position k
    lives in slot table[k // PAGE] * PAGE + k % PAGE, looked up per key."""
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pos_ok = pos < end
        page = tl.load(table + (pos // PAGE) * stride_tm, mask=pos_ok, other=0).to(tl.int64)
        slot = page * PAGE + pos % PAGE
        kv_mask = pos_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + slot[:, None] * stride_kn + kv_head * stride_kh + d[None, :], mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * qk_scale
        visible = (pos[None, :] >= k_start[:, None]) & (pos[None, :] < k_end[:, None]) & pos_ok[None, :]
        v = tl.load(v_ptr + slot[:, None] * stride_vn + kv_head * stride_vh + d[None, :], mask=kv_mask, other=0.0)
        m_i, l_i, acc = _softmax_step(qk, visible, m_i, l_i, acc, v.to(q.dtype), PRECISION)
    return m_i, l_i, acc


@triton.jit
def _attend_range(
    q, k_ptr, v_ptr, table, kv_head, start, end, k_start, k_end,
    stride_kn, stride_kh, stride_vn, stride_vh, stride_tm, qk_scale, d, d_ok,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """(max, sum, output) of the rows' softmax over the cached keys [start, end) alone (`_attend_cache`
    from an empty start)."""
    m_i = tl.full([q.shape[0]], float("-inf"), tl.float32)
    l_i = tl.zeros([q.shape[0]], tl.float32)
    acc = tl.zeros(q.shape, tl.float32)
    return _attend_cache(
        q, m_i, l_i, acc, k_ptr, v_ptr, table, kv_head, start, end, k_start, k_end,
        stride_kn, stride_kh, stride_vn, stride_vh, stride_tm, qk_scale, d, d_ok, PAGE, BLOCK_N, PRECISION,
    )  # fmt: skip


@triton.jit
def _fixed_split(lo, hi, split, BLOCK_N: tl.constexpr, SPLIT_KEYS: tl.constexpr):
    """Keys [start, end) of the rows' range [lo, hi) in split `split` of SPLIT_KEYS fixed positions
    (row invariance), starting on a key tile at a multiple of BLOCK_N."""
    return tl.maximum(lo // BLOCK_N * BLOCK_N, split * SPLIT_KEYS), tl.minimum(hi, (split + 1) * SPLIT_KEYS)


@triton.jit
def _sink_logits(sinks_ptr, h, HAS_SINKS: tl.constexpr):
    """The sink logit of each row's query head h (always a real head, padding rows too), in the
    log2 domain of the kernels' log-sum-exps; zeros, unread, without sinks."""
    if HAS_SINKS:
        return tl.load(sinks_ptr + h).to(tl.float32) * _LOG2E
    else:
        return tl.zeros(h.shape, tl.float32)


@triton.jit
def _fold_start(sink, rows, D_PAD: tl.constexpr, HAS_SINKS: tl.constexpr):
    """The running (max, denominator, output) of a fold of splits (`_fold`) before the first. With
    sinks the sink is a split of zero output: it starts the running max (finite, so a row that no
    split holds keys of gets 0, and no term overflows) and adds its weight at the end (`_folded`)."""
    m = tl.full(rows.shape, float("-inf"), tl.float32)
    if HAS_SINKS:
        m = sink
    return m, tl.zeros(rows.shape, tl.float32), tl.zeros([rows.shape[0], D_PAD], tl.float32)


@triton.jit
def _fold(m, den, acc, lse, part):
    """One split's partial output and log-sum-exp into the running sums, as the online softmax
    does; explicit FMAs, so that each path to a fold rounds alike (from a workspace or registers)."""
    m_new = tl.maximum(m, lse)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha, w = tl.exp2(m - m_safe), tl.exp2(lse - m_safe)
    return m_new, tl.fma(den, alpha, w), tl.fma(w[:, None], part, acc * alpha[:, None])


@triton.jit
def _folded(m, den, acc, sink, HAS_SINKS: tl.constexpr):
    """The rows' output from the fold's running sums."""
    if HAS_SINKS:
        den += tl.exp2(sink - m)
    return acc / tl.where(den == 0.0, 1.0, den)[:, None]


@triton.jit
def _combined(
    part_ptr, lse_ptr, sink, rows, num_splits, split_rows, row_ok, d, D_PAD: tl.constexpr, UNROLL: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):  # fmt: skip
    """The splits' partial outputs of `rows` (split 0's flat indices) folded in order by their
    log-sum-exps (`_fold`); the loads are independent of the running sums, so unrolled they are in
    flight together."""
    m, den, acc = _fold_start(sink, rows, D_PAD, HAS_SINKS)
    for i in tl.range(0, num_splits, loop_unroll_factor=UNROLL):
        at = i * split_rows + rows
        lse = tl.load(lse_ptr + at, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
        part = tl.load(
            part_ptr + at[:, None] * D_PAD + d[None, :], mask=row_ok[:, None], other=0.0, cache_modifier=".cg"
        )
        m, den, acc = _fold(m, den, acc, lse, part)
    return _folded(m, den, acc, sink, HAS_SINKS)


@triton.jit
def _split_partial(m_i, l_i, acc):
    """A split's (log-sum-exp in the log2 domain, normalized output) of its keys' running softmax:
    -inf and zeros where it holds none of a row's keys."""
    empty = l_i == 0.0
    l_i = tl.where(empty, 1.0, l_i)
    return tl.where(empty, float("-inf"), m_i + tl.log2(l_i)), acc / l_i[:, None]


@triton.jit
def _finish(
    m_i, l_i, acc, part_ptr, lse_ptr, arrivals_ptr, sink, group, split, num_splits, flat, split_rows, o_ptrs, row_ok,
    d, d_ok, D_PAD: tl.constexpr, SPLIT: tl.constexpr, ARRIVE: tl.constexpr, UNROLL: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):  # fmt: skip
    """The rows' output: normalized, to o_ptrs; with SPLIT a partial to part_ptr [splits, B, S, Hq,
    D_PAD] (fp32; zeros where the split holds none of a row's keys) and its log-sum-exp to lse_ptr
    [splits, B, S, Hq] (log2 domain) at `flat`, and the group's last split to arrive combines them.
    `sink`: the rows' sink logits (log2 domain, HAS_SINKS), added once a row's output is whole."""
    if SPLIT:  # the combine adds the sink (a partial's lse must stay its keys' own)
        lse, out = _split_partial(m_i, l_i, acc)
        tl.store(lse_ptr + flat, lse, mask=row_ok)
        tl.store(part_ptr + flat[:, None] * D_PAD + d[None, :], out, mask=row_ok[:, None])
        if ARRIVE:
            tl.debug_barrier()  # every thread's partial is stored before the arrival releases them
            if tl.atomic_add(arrivals_ptr + group, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
                tl.store(arrivals_ptr + group, 0)  # for the next launch (all splits have arrived)
                out = _combined(part_ptr, lse_ptr, sink, flat - split * split_rows, num_splits, split_rows, row_ok,
                                d, D_PAD, UNROLL, HAS_SINKS)  # fmt: skip
                tl.store(o_ptrs, out.to(o_ptrs.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        empty = l_i == 0.0  # a row that sees no key (acc is 0 there)
        l_i = tl.where(empty, 1.0, l_i)
        if HAS_SINKS:
            l_i += tl.exp2(sink - m_i)  # may overflow to inf, where the keys' weight rounds to 0 anyway
        out = acc / l_i[:, None]
        tl.store(o_ptrs, out.to(o_ptrs.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


# Arguments that change from call to call with the request (rows, batch, and the strides that
# follow them or the block tables' width): unspecialized, or Triton compiles a variant for each
# pattern of ones and multiples of 16 among them, in the middle of serving (eager prefills).
VARYING = ["B", "S", "stride_tb", "stride_sb", "stride_eb"]


@triton.jit(do_not_specialize=VARYING + ["stride_qb", "stride_ob"])
def _attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    k_start_ptr,
    k_end_ptr,
    sinks_ptr,
    out_ptr,
    part_ptr,
    lse_ptr,
    arrivals_ptr,
    B,
    S,
    Hkv,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_tb,
    stride_tm,
    stride_sb,
    stride_ss,
    stride_eb,
    stride_es,
    stride_ob,
    stride_os,
    stride_oh,
    qk_scale,
    G: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
    ARRIVE: tl.constexpr,
    UNROLL: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    SPLIT_KEYS: tl.constexpr,
    FOLD: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_previous_kernel(PDL)
    tile, bh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    num_splits = tl.num_programs(2)
    b, kv_head = bh // Hkv, bh % Hkv

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < S * G
    s = rows // G
    h = kv_head * G + rows % G
    d = tl.arange(0, D_PAD)
    d_ok = d < D

    k_start = tl.load(k_start_ptr + b * stride_sb + s * stride_ss, mask=row_ok, other=2**30).to(tl.int32)
    k_end = tl.load(k_end_ptr + b * stride_eb + s * stride_es, mask=row_ok, other=0).to(tl.int32)
    # This program's keys: its split's share of the union of its rows' ranges; with SPLIT_KEYS (row
    # invariance) its split's fixed positions, in key tiles at multiples of BLOCK_N.
    lo, hi = tl.min(k_start, 0), tl.max(k_end, 0)
    if SPLIT_KEYS > 0:
        # Splits past the tile's keys (a CUDA graph's tables span the context limit) hold none of
        # them and write no partial; the fold reads a row's own (an empty split only adds exact
        # zeros, so a row's bits are the same). Split 0 always runs.
        tile_splits = tl.maximum(tl.cdiv(hi, SPLIT_KEYS), 1)
        if not FOLD:
            num_splits = tl.minimum(tile_splits, num_splits)
            if split >= num_splits:
                return
            start, end = _fixed_split(lo, hi, split, BLOCK_N, SPLIT_KEYS)
    else:
        chunk = tl.cdiv(tl.cdiv(hi - lo, num_splits), BLOCK_N) * BLOCK_N
        start = lo + split * chunk
        end = tl.minimum(hi, start + chunk)

    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(
        q_ptr + b * stride_qb + s[:, None] * stride_qs + h[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0
    )
    table = table_ptr + b * stride_tb
    o_ptrs = out_ptr + b * stride_ob + s[:, None] * stride_os + h[:, None] * stride_oh + d[None, :]
    if FOLD:  # row invariance, one program a tile: its splits in turn, folded as the combine folds them
        sink = _sink_logits(sinks_ptr, h, HAS_SINKS)
        m, den, acc = _fold_start(sink, h, D_PAD, HAS_SINKS)
        for fixed in range(tile_splits):
            start, end = _fixed_split(lo, hi, fixed, BLOCK_N, SPLIT_KEYS)
            m_i, l_i, acc_i = _attend_range(
                q, k_ptr, v_ptr, table, kv_head, start, end, k_start, k_end,
                stride_kn, stride_kh, stride_vn, stride_vh, stride_tm, qk_scale, d, d_ok, PAGE, BLOCK_N, PRECISION,
            )  # fmt: skip
            lse, part = _split_partial(m_i, l_i, acc_i)
            m, den, acc = _fold(m, den, acc, lse, part)
        let_next_kernel_in(PDL)
        out = _folded(m, den, acc, sink, HAS_SINKS)
        tl.store(o_ptrs, out.to(o_ptrs.dtype.element_ty), mask=q_mask)
    else:
        m_i, l_i, acc = _attend_range(
            q, k_ptr, v_ptr, table, kv_head, start, end, k_start, k_end,
            stride_kn, stride_kh, stride_vn, stride_vh, stride_tm, qk_scale, d, d_ok, PAGE, BLOCK_N, PRECISION,
        )  # fmt: skip
        let_next_kernel_in(PDL)
        split_rows = B * S * Hkv * G
        flat = split * split_rows + (b * S + s) * (Hkv * G) + h
        group = bh * tl.num_programs(0) + tile
        sink = _sink_logits(sinks_ptr, h, HAS_SINKS)  # loaded after the key loop: no registers held across it
        _finish(m_i, l_i, acc, part_ptr, lse_ptr, arrivals_ptr, sink, group, split, num_splits, flat, split_rows,
                o_ptrs, row_ok, d, d_ok, D_PAD, SPLIT, ARRIVE, UNROLL, HAS_SINKS)  # fmt: skip


@triton.jit
def _norm_rope_rows(rows, w_ptr, cos_rows, sin_rows, eps, HAS_NORM: tl.constexpr, HALF: tl.constexpr):
    """Heads [R, 2 * HALF] read from row pointers `rows` [R], each RMS-normed with the weight at
    w_ptr (HAS_NORM) and rotated with its cos/sin row (`rms_norm_halves`, `rotate_halves`), in
    float32 rounded to the rows' dtype."""
    dtype = rows.dtype.element_ty
    d = tl.arange(0, HALF)
    x1 = tl.load(rows[:, None] + d[None, :]).to(tl.float32)
    x2 = tl.load(rows[:, None] + HALF + d[None, :]).to(tl.float32)
    if HAS_NORM:
        w1, w2 = tl.load(w_ptr + d).to(tl.float32)[None, :], tl.load(w_ptr + HALF + d).to(tl.float32)[None, :]
        x1, x2 = rms_norm_halves(x1, x2, w1, w2, eps, dtype, 2 * HALF)
    c1 = tl.load(cos_rows[:, None] + d[None, :]).to(tl.float32)
    c2 = tl.load(cos_rows[:, None] + HALF + d[None, :]).to(tl.float32)
    s1 = tl.load(sin_rows[:, None] + d[None, :]).to(tl.float32)
    s2 = tl.load(sin_rows[:, None] + HALF + d[None, :]).to(tl.float32)
    y1, y2 = rotate_halves(x1, x2, c1, c2, s1, s2)
    y1, y2 = y1.to(dtype), y2.to(dtype)
    return tl.reshape(tl.permute(tl.join(y1, y2), (0, 2, 1)), (y1.shape[0], 2 * HALF))  # [y1 | y2]


@triton.jit(do_not_specialize=VARYING + ["stride_pb", "stride_mb"])
def _qkv_attention_kernel(
    qkv_ptr, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, k_ptr, v_ptr, table_ptr, k_start_ptr,
    k_end_ptr, sinks_ptr, out_ptr, part_ptr, lse_ptr, arrivals_ptr, B, S, Hkv, stride_kn, stride_kh, stride_vn, stride_vh,
    stride_tb, stride_tm, stride_pb, stride_mb, stride_ms, stride_sb, stride_ss, stride_eb, stride_es, eps, qk_scale,
    G: tl.constexpr, HALF: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr, HAS_NORM: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
    TILES: tl.constexpr, ARRIVE: tl.constexpr, UNROLL: tl.constexpr, HAS_SINKS: tl.constexpr,
):  # fmt: skip
    """`_attention_kernel` for a step of S <= BLOCK_S new rows at positions [pos0, pos0 + S), its
    S * G query rows of a kv head in TILES tiles of BLOCK_M, reading the fused q|k|v projection
    itself: q is normed and rotated in registers, the splits share the cached keys [lo, pos0), and
    the last split also makes the new keys (k normed and rotated), attends to them and (tile 0)
    writes them and their values to the cache. It does so before its cached keys: done after the
    key loop, the new keys' work held registers across it (197 a thread rather than 154 at a decode
    launch, sm_90: 2 programs an SM instead of 3)."""
    wait_previous_kernel(PDL)
    bh, tile, split = tl.program_id(0) // TILES, tl.program_id(0) % TILES, tl.program_id(1)
    num_splits = tl.num_programs(1)
    b, kv_head = bh // Hkv, bh % Hkv
    D: tl.constexpr = 2 * HALF
    HQ = Hkv * G
    heads = HQ + 2 * Hkv
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < S * G
    s = tl.minimum(rows // G, S - 1)  # clamped: padding rows read a real row, never stored
    h = kv_head * G + rows % G
    d = tl.arange(0, D)
    d_ok = d < D

    k_start = tl.load(k_start_ptr + b * stride_sb + s * stride_ss, mask=row_ok, other=2**30).to(tl.int32)
    k_end = tl.load(k_end_ptr + b * stride_eb + s * stride_es, mask=row_ok, other=0).to(tl.int32)
    pos0 = tl.load(pos_ptr + b * stride_pb).to(tl.int32)
    lo = tl.min(k_start, 0)
    chunk = tl.cdiv(tl.cdiv(tl.maximum(pos0 - lo, 0), num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * chunk
    end = tl.minimum(pos0, start + chunk)

    token = b * S + s  # qkv [B, S, heads, D], cos/sin [B, S, D]: contiguous
    q = _norm_rope_rows(qkv_ptr + (token * heads + h) * D, q_norm_ptr, cos_ptr + token * D, sin_ptr + token * D, eps,
                        HAS_NORM, HALF)  # fmt: skip
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    if split == num_splits - 1:
        j = tl.arange(0, BLOCK_S)
        j_ok = j < S
        new = b * S + tl.minimum(j, S - 1)
        k_rows = qkv_ptr + (new * heads + HQ + kv_head) * D
        k = _norm_rope_rows(k_rows, k_norm_ptr, cos_ptr + new * D, sin_ptr + new * D, eps, HAS_NORM, HALF)
        v = tl.load(k_rows[:, None] + Hkv * D + d[None, :])
        slot = tl.load(slot_ptr + b * stride_mb + tl.minimum(j, S - 1) * stride_ms).to(tl.int64)
        write = (j_ok & (tile == 0))[:, None]  # each tile makes the new keys, the first writes them
        tl.store(k_ptr + slot[:, None] * stride_kn + kv_head * stride_kh + d[None, :], k, mask=write)
        tl.store(v_ptr + slot[:, None] * stride_vn + kv_head * stride_vh + d[None, :], v, mask=write)
        pos = pos0 + j
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        visible = (pos[None, :] >= k_start[:, None]) & (pos[None, :] < k_end[:, None]) & j_ok[None, :]
        m_i, l_i, acc = _softmax_step(qk, visible, m_i, l_i, acc, v, PRECISION)
    m_i, l_i, acc = _attend_cache(
        q, m_i, l_i, acc, k_ptr, v_ptr, table_ptr + b * stride_tb, kv_head, start, end, k_start, k_end,
        stride_kn, stride_kh, stride_vn, stride_vh, stride_tm, qk_scale, d, d_ok, PAGE, BLOCK_N, PRECISION,
    )  # fmt: skip
    let_next_kernel_in(PDL)
    split_rows = B * S * HQ
    flat = split * split_rows + token * HQ + h
    o_ptrs = out_ptr + (token * HQ + h)[:, None] * D + d[None, :]  # out [B, S, Hq, D] contiguous
    sink = _sink_logits(sinks_ptr, h, HAS_SINKS)
    _finish(m_i, l_i, acc, part_ptr, lse_ptr, arrivals_ptr, sink, tl.program_id(0), split, num_splits, flat,
            split_rows, o_ptrs, row_ok, d, d_ok, D, SPLIT, ARRIVE, UNROLL, HAS_SINKS)  # fmt: skip


@triton.jit(do_not_specialize=["S", "num_rows", "stride_ob", "num_splits"])
def _combine_kernel(
    part_ptr,
    lse_ptr,
    sinks_ptr,
    out_ptr,
    S,
    Hq,
    num_rows,
    stride_ob,
    stride_os,
    stride_oh,
    num_splits,
    SPLITS_PAD: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    PDL: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    await_previous_kernel(PDL)
    row = tl.program_id(0)  # flat (b, s, h)
    sp = tl.arange(0, SPLITS_PAD)
    sp_ok = sp < num_splits
    d = tl.arange(0, D_PAD)
    lse = tl.load(lse_ptr + sp * num_rows + row, mask=sp_ok, other=float("-inf"))
    m = tl.max(lse, 0)  # without sinks every row has a key, so some split's lse is finite
    if HAS_SINKS:  # the sink: a split of zero output, in the max (finite then) and the denominator
        sink = tl.load(sinks_ptr + row % Hq).to(tl.float32) * _LOG2E
        m = tl.maximum(m, sink)
    w = tl.exp2(lse - m)
    part = tl.load(part_ptr + (sp[:, None] * num_rows + row) * D_PAD + d[None, :], mask=sp_ok[:, None], other=0.0)
    total = tl.sum(w, 0)
    if HAS_SINKS:
        total += tl.exp2(sink - m)
    out = tl.sum(w[:, None] * part, 0) / total
    b, s, h = row // (S * Hq), (row // Hq) % S, row % Hq
    tl.store(out_ptr + b * stride_ob + s * stride_os + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


@triton.jit(do_not_specialize=["S", "num_rows", "stride_ob", "stride_eb", "max_splits"])
def _fold_kernel(
    part_ptr, lse_ptr, sinks_ptr, out_ptr, k_end_ptr, S, Hq, num_rows, stride_ob, stride_os, stride_oh, stride_eb,
    stride_es, max_splits, ROWS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, SPLIT_KEYS: tl.constexpr,
    UNROLL: tl.constexpr, PDL: tl.constexpr, HAS_SINKS: tl.constexpr,
):  # fmt: skip
    """Row invariance's combine of its splits: ROWS flat (b, s, h) rows a program, heads of one
    (b, s) (ROWS divides Hq), their splits folded in order (`_combined`, as a folding program does)
    up to the last that holds their keys (the tile's later ones add exact zeros; past the tile's
    keys none was written), at most the launch's `max_splits`. Programs of a few rows spread the
    fold over the SMs: one program's pass over a 64-row tile's splits is long."""
    await_previous_kernel(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < num_rows
    b, s, h = rows // (S * Hq), (rows // Hq) % S, rows % Hq
    k_end = tl.load(k_end_ptr + b * stride_eb + s * stride_es, mask=row_ok, other=0).to(tl.int32)
    num_splits = tl.minimum(tl.maximum(tl.cdiv(tl.max(k_end, 0), SPLIT_KEYS), 1), max_splits)
    d = tl.arange(0, D_PAD)
    sink = _sink_logits(sinks_ptr, h, HAS_SINKS)
    out = _combined(part_ptr, lse_ptr, sink, rows, num_splits, num_rows, row_ok, d, D_PAD, UNROLL, HAS_SINKS)
    o_ptrs = out_ptr + b[:, None] * stride_ob + s[:, None] * stride_os + h[:, None] * stride_oh + d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (d < D)[None, :])


def choose_splits(programs: int, max_keys: int, sms: int) -> int:
    """Split the keys when the unsplit grid leaves SMs idle: aim for about two programs per SM,
    each split holding at least MIN_KEYS_PER_SPLIT of the longest possible range (M * page_size;
    shorter actual ranges just leave the last splits empty)."""
    if programs >= sms:
        return 1
    return max(1, min(triton.cdiv(2 * sms, programs), max_keys // MIN_KEYS_PER_SPLIT, MAX_SPLITS))


def query_tiles(rows: int, max_rows: int = MAX_ROWS) -> tuple[int, int]:
    """(rows per program, programs per (sequence, kv head)) for `rows` = S * G query rows, at most
    `max_rows` a program."""
    block_m = max(16, min(max_rows, triton.next_power_of_2(rows)))
    return block_m, triton.cdiv(rows, block_m)


def step_grid(batch: int, kv_heads: int, rows: int, max_keys: int, sms: int) -> tuple[int, int, int]:
    """(rows per program, query tiles, key splits) of a step's fused launch (`qkv_attention_triton`)
    for `rows` = S * G query rows of each (sequence, kv head): one tile of them, split by
    `choose_splits`; or tiles of 16 rows, split until 3 programs an SM (one wave at <= 168
    registers a thread), where that leaves each split at most twice the keys (at Qwen3-8B's 8 kv
    heads: a verify at B = 1 with tables under 1,600 keys, B = 2 and 3 under 832 and 576). A
    program's work before its keys (q normed and rotated) is issued row by row, and every split
    repeats it: in one 64-row tile it takes a large part of a small batch's attention, and tiles
    of 16 rows cut it by four."""
    block_m, tiles = query_tiles(rows)
    splits = choose_splits(batch * kv_heads * tiles, max_keys, sms)
    small_m, small_tiles = query_tiles(rows, 16)
    programs = batch * kv_heads * small_tiles
    small_splits = min(3 * sms // programs, max_keys // MIN_KEYS_PER_SPLIT, MAX_SPLITS)
    if small_tiles > tiles and 2 * small_splits >= splits:
        return small_m, small_tiles, small_splits
    return block_m, tiles, splits


@dataclass(frozen=True)
class AttentionHeads:
    """A model's attention as its kernel launches see it: kv heads, query heads a kv head, whether
    its layers take the fused step kernel (`fuses_qkv`: whole-head rotary, a power-of-two head dim,
    the cache in the model's dtype), and the SMs the grid fills."""

    kv_heads: int
    group: int
    fused: bool
    sms: int


def launch_variant(batch: int, rows: int, max_keys: int, heads: AttentionHeads) -> tuple:
    """What selects the attention kernels' compiled variant (their constexprs) at a launch for
    `batch` sequences of `rows` rows over tables of `max_keys` keys: the fused step kernel where one
    tile holds the rows and the model takes it, else the prefill kernel, each with its split
    flags; and the combine kernel's split padding, where it runs."""
    kv_heads, sms = heads.kv_heads, heads.sms
    q_rows = rows * heads.group
    if heads.fused and q_rows <= MAX_ROWS:
        block_m, tiles, splits = step_grid(batch, kv_heads, q_rows, max_keys, sms)
        kernel = ("qkv", block_m, tiles, max(16, triton.next_power_of_2(rows)))
    else:
        block_m, tiles = query_tiles(q_rows)
        splits = choose_splits(batch * kv_heads * tiles, max_keys, sms)
        kernel = ("attention", block_m)
    flags = split_flags(splits, block_m)
    combine = triton.next_power_of_2(splits) if flags["SPLIT"] and not flags["ARRIVE"] else None
    return (*kernel, flags["SPLIT"], flags["ARRIVE"], combine)


def prefill_variants(
    heads: AttentionHeads, page_size: int, max_batch: int, max_rows: int, max_pages: int
) -> dict[tuple, tuple[int, int, int]]:
    """A prefill shape (sequences, rows, table pages) of each variant `launch_variant` reaches with
    at most max_batch sequences, max_rows rows and max_pages pages. Rows matter through their query
    tiles, pages through the splits (none past MAX_SPLITS full splits), sequences until the grid
    fills the SMs (no split after that)."""
    row_classes: dict[tuple, int] = {}
    for rows in range(1, max_rows + 1):
        q_rows = rows * heads.group
        tiles = (query_tiles(q_rows), query_tiles(q_rows, 16), max(16, triton.next_power_of_2(rows)))
        row_classes.setdefault((q_rows <= MAX_ROWS, *tiles), rows)
        if heads.kv_heads * query_tiles(q_rows)[1] >= heads.sms:  # one sequence fills the SMs: no split past it
            break
    # the splits change where the keys pass a multiple of MIN_KEYS_PER_SPLIT, up to MAX_SPLITS of them
    steps = [-(-k * MIN_KEYS_PER_SPLIT // page_size) for k in range(1, MAX_SPLITS + 2)]
    shapes: dict[tuple, tuple[int, int, int]] = {}
    for rows in row_classes.values():
        least = -(-rows // page_size)
        pages = sorted({least, *(p for p in steps if least < p <= max_pages)})
        for batch in range(1, max_batch + 1):
            for p in pages:
                shapes.setdefault(launch_variant(batch, rows, p * page_size, heads), (batch, rows, p))
            if batch * heads.kv_heads >= 3 * heads.sms:  # past three programs an SM no launch splits its keys
                break
    return shapes


def default_splits(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, page_size: int) -> int:
    B, S, Hq, _ = q.shape
    Hkv = k_cache.shape[1]
    _, tiles = query_tiles(S * (Hq // Hkv))
    sms = num_sms(q.device, interpreted=132)  # interpreter: as the H200
    return choose_splits(B * Hkv * tiles, block_tables.shape[1] * page_size, sms)


def _key_tile(dtype: torch.dtype, d_pad: int) -> dict:
    fp32 = dtype == torch.float32
    block_n = 32 if fp32 or d_pad > 128 else 64
    return {"BLOCK_N": block_n, "PRECISION": "ieee" if fp32 else "tf32", "num_warps": 4, "num_stages": 2 if fp32 else 3}


def _partials(num_splits: int, out: torch.Tensor, d_pad: int, split: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-K's partial outputs [splits, B, S, Hq, d_pad] and log-sum-exps (`out` itself unsplit)."""
    if not split:
        return out, out  # lse unused
    part = torch.empty((num_splits, *out.shape[:-1], d_pad), dtype=torch.float32, device=out.device)
    return part, torch.empty(part.shape[:-1], dtype=torch.float32, device=out.device)


# Up to this many splits, the last split of a tile to arrive combines them (`_finish`); above, the
# combine kernel does, its programs spread over the SMs: one program's serial pass over many splits
# costs more than the launch it saves, over a few it gains.
ARRIVE_MAX_SPLITS = 4
_ARRIVALS: dict[torch.device, list[torch.Tensor]] = {}


def _arrivals(device: torch.device, groups: int) -> torch.Tensor:
    """Split-K's arrival counters, one per program group (the splits of one tile), zero between
    launches: a group's last split resets its own. One set per device, kept for the process (a
    CUDA graph holds their address); kernels on one stream share them, in turn."""
    held = _ARRIVALS.setdefault(device, [])
    if not held or held[-1].numel() < groups:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("split-K arrival counters must be allocated before CUDA graph capture (run once first)")
        held.append(torch.zeros(max(groups, 1024), dtype=torch.int32, device=device))
    return held[-1]


def split_flags(num_splits: int, block_m: int) -> dict:
    """The attention kernels' split-K constexprs: split or not, combined by the last split to arrive
    or not, and how many splits that one's combine loads at once (64 rows of partials)."""
    return {"SPLIT": num_splits > 1, "ARRIVE": 1 < num_splits <= ARRIVE_MAX_SPLITS, "UNROLL": max(1, 64 // block_m)}


# Row invariance: keys split at fixed positions, this many a split; where the splits run as
# programs of their own, a launch takes as many query rows as keep its partials (fp32, a split
# each, as many as the block tables' width holds) within INVARIANT_PARTIALS_BYTES: a step's rows in
# one launch at short tables, a long prefill's in several.
INVARIANT_SPLIT_KEYS = 256
INVARIANT_PARTIALS_BYTES = 1 << 30
INVARIANT_COMBINE_UNROLL = 4  # partials a fold has in flight: long contexts fold many
FOLD_PROGRAMS_PER_SM = 2  # tiles a launch needs for each to fold its own splits: the SMs kept busy


def invariant_folds(rows: int, programs: int, sms: int) -> bool:
    """Whether a launch of `rows` query rows of a kv head for `programs` (sequence, kv head) pairs
    runs each tile's splits in one program, folded in registers (`_attention_kernel`'s FOLD): where
    its tiles alone fill the SMs, else the splits run as programs of their own."""
    return triton.cdiv(rows, MAX_ROWS) * programs >= FOLD_PROGRAMS_PER_SM * sms


def invariant_fold_prefill(heads: AttentionHeads, max_batch: int, max_rows: int) -> tuple[int, int] | None:
    """(sequences, rows) of the least prefill, within max_batch sequences of max_rows rows, whose
    row-invariant attention folds each tile's splits in its one program (`invariant_folds`: its
    tiles fill the SMs); None where none does."""
    for batch in range(1, max_batch + 1):
        tiles = triton.cdiv(FOLD_PROGRAMS_PER_SM * heads.sms, batch * heads.kv_heads)
        rows = triton.cdiv((tiles - 1) * MAX_ROWS + 1, heads.group)
        if rows <= max_rows:
            return batch, rows
    return None


def invariant_call_positions(batch: int, heads: int, max_keys: int, d_pad: int) -> int:
    """Query positions a row-invariant launch of `batch` sequences takes where its splits write
    partials: as many as keep those (and their log-sum-exps) within INVARIANT_PARTIALS_BYTES, at
    least one."""
    splits = triton.cdiv(max(max_keys, 1), INVARIANT_SPLIT_KEYS)
    return max(1, INVARIANT_PARTIALS_BYTES // (batch * heads * splits * (d_pad + 1) * 4))


def invariant_launch(rows: int, max_keys: int, fold: bool) -> tuple[int, int, int, dict]:
    """(rows per program, query tiles, key splits, split flags) under row invariance
    (`blockspec.layers.row_invariant`): every call the same query tile (MAX_ROWS rows: the same MMA
    shapes and reduction layouts for a row wherever it sits) and splits of INVARIANT_SPLIT_KEYS
    fixed positions, folded in order (`_fold`) by `_fold_kernel` or, with `fold`, by the tile's one
    program as it goes (the unsplit normalization and the tree of the combine kernel would round a
    row differently). A split past a row's keys, or a key tile, adds exact zeros, so their number
    does not matter; splits past all the tile's keys end at once, unwritten and unread."""
    tiles = triton.cdiv(rows, MAX_ROWS)
    if fold:
        return MAX_ROWS, tiles, 1, {"SPLIT": False, "ARRIVE": False, "UNROLL": 1}
    num_splits = triton.cdiv(max(max_keys, 1), INVARIANT_SPLIT_KEYS)
    return MAX_ROWS, tiles, num_splits, {"SPLIT": True, "ARRIVE": False, "UNROLL": 1}


def _split_outputs(num_splits: int, out: torch.Tensor, d_pad: int, groups: int, flags: dict) -> list[torch.Tensor]:
    """[out, partials, lse, arrival counters] as the kernels take them (unsplit: out in every place, unread)."""
    part, lse = _partials(num_splits, out, d_pad, flags["SPLIT"])
    return [out, part, lse, _arrivals(out.device, groups) if flags["ARRIVE"] else out]


def _sinks(sinks: torch.Tensor | None, heads: int, out: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The kernels' sinks_ptr and HAS_SINKS: the sink logits [Hq] (any float dtype), or `out` in
    their place, unread."""
    if sinks is None:
        return out, {"HAS_SINKS": False}
    assert sinks.shape == (heads,) and sinks.is_floating_point(), f"sinks {tuple(sinks.shape)}: one per query head"
    return sinks.contiguous(), {"HAS_SINKS": True}


def _combine(outputs: list[torch.Tensor], flags: dict, sinks: torch.Tensor, has_sinks: dict) -> None:
    """The combine kernel, where the keys were split and the splits did not combine as they arrived."""
    if not flags["SPLIT"] or flags["ARRIVE"]:
        return
    out, part, lse, _ = outputs
    num_splits, (B, S, Hq, D), d_pad = part.shape[0], out.shape, part.shape[-1]
    _combine_kernel[(B * S * Hq,)](
        part, lse, sinks, out, S, Hq, B * S * Hq, out.stride(0), out.stride(1), out.stride(2), num_splits,
        SPLITS_PAD=triton.next_power_of_2(num_splits), D=D, D_PAD=d_pad, num_warps=1 if d_pad <= 64 else 2,
        **has_sinks, **pdl_launch(out.device),
    )  # fmt: skip


def _fold_splits(outputs: list[torch.Tensor], k_end: torch.Tensor, sinks: torch.Tensor, has_sinks: dict) -> None:
    """`_fold_kernel` over row invariance's splits."""
    out, part, lse, _ = outputs
    (B, S, Hq, D), d_pad = out.shape, part.shape[-1]
    rows = min(4, Hq & -Hq)  # heads of one row, the largest power of two dividing Hq up to 4
    _fold_kernel[(triton.cdiv(B * S * Hq, rows),)](
        part, lse, sinks, out, k_end, S, Hq, B * S * Hq, out.stride(0), out.stride(1), out.stride(2),
        k_end.stride(0), k_end.stride(1), part.shape[0], ROWS=rows, D=D, D_PAD=d_pad, SPLIT_KEYS=INVARIANT_SPLIT_KEYS,
        UNROLL=INVARIANT_COMBINE_UNROLL, **has_sinks, num_warps=1, **pdl_launch(out.device),
    )  # fmt: skip


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    k_start: torch.Tensor,
    k_end: torch.Tensor,
    page_size: int,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    invariant: bool = False,
) -> torch.Tensor:
    """q [B, S, Hq, D]; caches [num_slots, Hkv, D]; block_tables [B, M]; k_start, k_end [B, S]
    (any integer dtype, any strides); returns [B, S, Hq, D] in q's dtype (written into `out`
    when given). `num_splits` overrides the split-K heuristic (1: no split). `sinks` [Hq]: each
    head's attention-sink logit (gpt-oss; None: no sinks); with sinks a row that sees no key gets
    zeros, as in the reference (the sink takes all its weight). `invariant`: each row's result the
    same bits whatever the batch (`invariant_launch`; a long prefill's rows in several launches)."""
    B, S, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    q, k_cache, v_cache = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k_cache, v_cache))
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    fold = invariant and invariant_folds(S * (Hq // Hkv), B * Hkv, num_sms(q.device, interpreted=8))
    max_keys, d_pad = block_tables.shape[1] * page_size, triton.next_power_of_2(D)
    rows_per_call = invariant_call_positions(B, Hq, max_keys, d_pad) if invariant and not fold else S
    if S > rows_per_call:  # row invariance: a row's result does not depend on the rows beside it
        for s0 in range(0, S, rows_per_call):
            part = slice(s0, s0 + rows_per_call)
            paged_attention_triton(
                q[:, part], k_cache, v_cache, block_tables, k_start[:, part], k_end[:, part], page_size, scale,
                out=out[:, part], sinks=sinks, invariant=True,
            )  # fmt: skip
        return out
    if invariant:
        block_m, tiles, num_splits, flags = invariant_launch(S * (Hq // Hkv), max_keys, fold)
    else:
        block_m, tiles = query_tiles(S * (Hq // Hkv))
        num_splits = num_splits or default_splits(q, k_cache, block_tables, page_size)
        flags = split_flags(num_splits, block_m)
    outputs = _split_outputs(num_splits, out, d_pad, tiles * B * Hkv, flags)
    sinks, has_sinks = _sinks(sinks, Hq, out)
    _attention_kernel[(tiles, B * Hkv, num_splits)](
        q, k_cache, v_cache, block_tables, k_start, k_end, sinks, *outputs, B, S, Hkv,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), block_tables.stride(0), block_tables.stride(1), k_start.stride(0), k_start.stride(1),
        k_end.stride(0), k_end.stride(1), out.stride(0), out.stride(1), out.stride(2), scale * LOG2E,
        G=Hq // Hkv, D=D, D_PAD=d_pad, PAGE=page_size, BLOCK_M=block_m, **flags, **has_sinks,
        SPLIT_KEYS=INVARIANT_SPLIT_KEYS if invariant else 0, FOLD=fold, **_key_tile(q.dtype, d_pad),
        **pdl_launch(q.device),
    )  # fmt: skip
    if invariant and not fold:
        _fold_splits(outputs, k_end, sinks, has_sinks)
    else:
        _combine(outputs, flags, sinks, has_sinks)
    return out


def fuses_qkv(qkv: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether `qkv_attention_triton` takes this step: some rows, all in one query tile, a head dim
    that is a power of two (rotary halves without masks), and a cache in qkv's dtype (the new keys
    are attended as computed, and must be what later steps read back)."""
    S, heads, D = qkv.shape[-3:]
    Hkv = k_cache.shape[1]
    G = (heads - 2 * Hkv) // Hkv
    pow2 = D >= 16 and D == triton.next_power_of_2(D)
    return 0 < S * G <= MAX_ROWS and pow2 and qkv.is_contiguous() and k_cache.dtype == qkv.dtype


def qkv_attention_triton(
    qkv: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    starts: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    k_start: torch.Tensor,
    k_end: torch.Tensor,
    page_size: int,
    scale: float,
    num_splits: int | None = None,
    block_m: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`qk_norm_rope` with the K/V write, then `paged_attention_triton`, in one launch (+ the
    split-K combine), for a step whose rows sit at positions starts[b] + s and fit one 64-row query
    tile (`fuses_qkv`). qkv [B, S, Hq + 2 Hkv, D] contiguous, left as it is (q and k are rotated in
    registers); q_norm, k_norm [D] (or both None); cos, sin [B, S, D]; starts [B]; slot_mapping,
    k_start, k_end [B, S] (any integer dtype, any strides); caches [slots, Hkv, D] contiguous.
    Padding rows past a sequence's real ones may sit anywhere: the keys they make land at positions
    past every real row's k_end, in slots no real row reads (the engine's trash slot 0). Returns
    [B, S, Hq, D]. `block_m` (query rows a program, at most) replaces `step_grid`'s tiles (the
    splits then follow `choose_splits`); `num_splits` replaces the splits. `sinks` [Hq]: as in
    `paged_attention_triton`."""
    B, S, heads, D = qkv.shape
    Hkv = k_cache.shape[1]
    Hq = heads - 2 * Hkv
    assert fuses_qkv(qkv, k_cache), f"qkv {tuple(qkv.shape)} with a cache {tuple(k_cache.shape)}: not one step"
    assert (q_norm is None) == (k_norm is None), "q and k norm weights come together"
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[1:] == (Hkv, D)
    cos, sin = cos.expand(B, S, D).contiguous(), sin.expand(B, S, D).contiguous()
    out = torch.empty((B, S, Hq, D), dtype=qkv.dtype, device=qkv.device)
    rows, max_keys, sms = S * (Hq // Hkv), block_tables.shape[1] * page_size, num_sms(qkv.device, interpreted=132)
    if block_m is None:
        block_m, tiles, splits = step_grid(B, Hkv, rows, max_keys, sms)
    else:
        block_m, tiles = query_tiles(rows, block_m)
        splits = choose_splits(B * Hkv * tiles, max_keys, sms)
    num_splits = num_splits or splits
    flags = split_flags(num_splits, block_m)
    outputs = _split_outputs(num_splits, out, D, B * Hkv * tiles, flags)
    norms = (q_norm, k_norm) if q_norm is not None else (cos, cos)  # unread without HAS_NORM
    sinks, has_sinks = _sinks(sinks, Hq, out)
    _qkv_attention_kernel[(B * Hkv * tiles, num_splits)](
        qkv, *norms, cos, sin, starts, slot_mapping, k_cache, v_cache, block_tables, k_start, k_end, sinks, *outputs,
        B, S, Hkv, k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_tables.stride(0), block_tables.stride(1), starts.stride(0), slot_mapping.stride(0),
        slot_mapping.stride(1), k_start.stride(0), k_start.stride(1), k_end.stride(0), k_end.stride(1), eps,
        scale * LOG2E, G=Hq // Hkv, HALF=D // 2, PAGE=page_size, BLOCK_M=block_m, TILES=tiles,
        BLOCK_S=max(16, triton.next_power_of_2(S)), HAS_NORM=q_norm is not None, **flags, **has_sinks,
        **_key_tile(qkv.dtype, D), **pdl_launch(qkv.device),
    )  # fmt: skip
    _combine(outputs, flags, sinks, has_sinks)
    return out
