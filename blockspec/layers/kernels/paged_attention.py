"""Paged attention in Triton: the CUDA implementation of `paged_attention` (same contract as
`blockspec.layers.attention.paged_attention_ref`).

One program handles one (sequence b, kv head, tile of query rows[, key split]). Its query rows
are the S*G (row, head) pairs of that kv head, flattened as r = s*G + g (query head
kv_head*G + g), so GQA heads share every K/V load; a tile holds up to 64 rows (padded to a power
of two, at least 16 for tl.dot), so decode/verify (S <= 16) is one tile and long prefills use
several. The program streams the keys of [min k_start, max k_end) over its rows in tiles of
BLOCK_N positions: position k lives in slot block_tables[b, k // page_size] * page_size +
k % page_size, looked up per key (pages need not be contiguous, and page_size need not divide
BLOCK_N). Online softmax in fp32 (exp2, scale folded into log2 e), per-row masks from
k_start/k_end.

Split-K (flash-decoding): when there are too few programs to fill the GPU (small batch, long
context) the key range of each program is cut into `num_splits` chunks handled by separate
programs, each writing a normalized partial output and its log-sum-exp; a second kernel
combines them. The chunk boundaries are computed inside the kernel from the actual key range,
so the launch grid depends only on shapes (B, S, M, Hkv): the call has no host sync and can be
captured in a CUDA graph.
"""

import torch
import triton
import triton.language as tl

from blockspec.layers.kernels import num_sms

LOG2E = 1.4426950408889634
MAX_ROWS = 64  # query rows per program
MIN_KEYS_PER_SPLIT = 128
MAX_SPLITS = 32


@triton.jit
def _attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    k_start_ptr,
    k_end_ptr,
    out_ptr,
    lse_ptr,
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
):
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
    # This program's keys: its split's share of the union of its rows' ranges.
    lo, hi = tl.min(k_start, 0), tl.max(k_end, 0)
    chunk = tl.cdiv(tl.cdiv(hi - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * chunk
    end = tl.minimum(hi, start + chunk)

    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(
        q_ptr + b * stride_qb + s[:, None] * stride_qs + h[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0
    )
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    table = table_ptr + b * stride_tb
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pos_ok = pos < end
        page = tl.load(table + (pos // PAGE) * stride_tm, mask=pos_ok, other=0).to(tl.int64)
        slot = page * PAGE + pos % PAGE
        kv_mask = pos_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + slot[:, None] * stride_kn + kv_head * stride_kh + d[None, :], mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * qk_scale
        visible = (pos[None, :] >= k_start[:, None]) & (pos[None, :] < k_end[:, None]) & pos_ok[None, :]
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
        p = tl.exp2(qk - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + slot[:, None] * stride_vn + kv_head * stride_vh + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
        m_i = m_new

    empty = l_i == 0.0  # only possible for a split that holds none of a row's keys
    l_i = tl.where(empty, 1.0, l_i)
    out = acc / l_i[:, None]
    if SPLIT:
        # Partials: out [splits, B, S, Hq, D_PAD] fp32, lse [splits, B, S, Hq] (log2 domain).
        flat = ((split * B + b) * S + s) * (Hkv * G) + h
        tl.store(lse_ptr + flat, tl.where(empty, float("-inf"), m_i + tl.log2(l_i)), mask=row_ok)
        tl.store(out_ptr + flat[:, None] * D_PAD + d[None, :], out, mask=(row_ok & ~empty)[:, None])
    else:
        o_ptrs = out_ptr + b * stride_ob + s[:, None] * stride_os + h[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _combine_kernel(
    part_ptr,
    lse_ptr,
    out_ptr,
    S,
    Hq,
    num_rows,
    stride_ob,
    stride_os,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
):
    row = tl.program_id(0)  # flat (b, s, h)
    sp = tl.arange(0, SPLITS_PAD)
    sp_ok = sp < NUM_SPLITS
    d = tl.arange(0, D_PAD)
    lse = tl.load(lse_ptr + sp * num_rows + row, mask=sp_ok, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))  # every row has a key, so some split's lse is finite
    used = sp_ok & (lse > float("-inf"))  # splits with none of the row's keys wrote no partial
    part = tl.load(part_ptr + (sp[:, None] * num_rows + row) * D_PAD + d[None, :], mask=used[:, None], other=0.0)
    out = tl.sum(w[:, None] * part, 0) / tl.sum(w, 0)
    b, s, h = row // (S * Hq), (row // Hq) % S, row % Hq
    tl.store(out_ptr + b * stride_ob + s * stride_os + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


def choose_splits(programs: int, max_keys: int, sms: int) -> int:
    """Split the keys when the unsplit grid leaves SMs idle: aim for about two programs per SM,
    each split holding at least MIN_KEYS_PER_SPLIT of the longest possible range (M * page_size;
    shorter actual ranges just leave the last splits empty)."""
    if programs >= sms:
        return 1
    return max(1, min(triton.cdiv(2 * sms, programs), max_keys // MIN_KEYS_PER_SPLIT, MAX_SPLITS))


def query_tiles(rows: int) -> tuple[int, int]:
    """(rows per program, programs per (sequence, kv head)) for `rows` = S * G query rows."""
    block_m = max(16, min(MAX_ROWS, triton.next_power_of_2(rows)))
    return block_m, triton.cdiv(rows, block_m)


def default_splits(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, page_size: int) -> int:
    B, S, Hq, _ = q.shape
    Hkv = k_cache.shape[1]
    _, tiles = query_tiles(S * (Hq // Hkv))
    sms = num_sms(q.device, interpreted=132)  # interpreter: as the H200
    return choose_splits(B * Hkv * tiles, block_tables.shape[1] * page_size, sms)


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
) -> torch.Tensor:
    """q [B, S, Hq, D]; caches [num_slots, Hkv, D]; block_tables [B, M]; k_start, k_end [B, S]
    (any integer dtype, any strides); returns [B, S, Hq, D] in q's dtype (written into `out`
    when given). `num_splits` overrides the split-K heuristic (1: no split)."""
    B, S, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    G = Hq // Hkv
    q, k_cache, v_cache = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k_cache, v_cache))
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    block_m, tiles = query_tiles(S * G)
    if num_splits is None:
        num_splits = default_splits(q, k_cache, block_tables, page_size)
    d_pad = triton.next_power_of_2(D)
    fp32 = q.dtype == torch.float32
    block_n = 32 if fp32 or d_pad > 128 else 64
    split = num_splits > 1
    if split:
        part = torch.empty((num_splits, B, S, Hq, d_pad), dtype=torch.float32, device=q.device)
        lse = torch.empty((num_splits, B, S, Hq), dtype=torch.float32, device=q.device)
    else:
        part, lse = out, out  # lse unused
    _attention_kernel[(tiles, B * Hkv, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        k_start,
        k_end,
        part,
        lse,
        B,
        S,
        Hkv,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        block_tables.stride(0),
        block_tables.stride(1),
        k_start.stride(0),
        k_start.stride(1),
        k_end.stride(0),
        k_end.stride(1),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        scale * LOG2E,
        G=G,
        D=D,
        D_PAD=d_pad,
        PAGE=page_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        SPLIT=split,
        PRECISION="ieee" if fp32 else "tf32",
        num_warps=4,
        num_stages=2 if fp32 else 3,
    )
    if split:
        _combine_kernel[(B * S * Hq,)](
            part,
            lse,
            out,
            S,
            Hq,
            B * S * Hq,
            out.stride(0),
            out.stride(1),
            out.stride(2),
            NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            D=D,
            D_PAD=d_pad,
            num_warps=1 if d_pad <= 64 else 2,
        )
    return out
