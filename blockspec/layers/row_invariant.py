"""Row-invariant numerics: each row's result is the same bits whatever rows share the call.

A GEMM library picks its kernel, blocking and split of the reduction by the shape of the call
(MKL's fp32 GEMM rounds row 0 differently at 1, 2, 4 and 16 rows; the skinny kernel takes a GEMV
at one row and splits K by the row count),
and attention kernels split the keys by the batch. A token's logits then move with the batch
size, the draft width and the prefill chunking, near-ties flip, and bf16 speculative decoding
leaves plain decoding. With `KernelConfig.row_invariant` in force every product runs at shapes
that do not depend on the call:
- linear: the rows in tiles of ROW_TILE (the last one padded with zeros), one GEMM a tile, on the
  weight's packed copy where the CPU has one; all rows in one GEMM on the packed copy (float32
  or bf16) instead where oneDNN keeps a row's bits at any row count (`cpu_gemm.invariant_rows`);
- attention: the keys in chunks of KEY_CHUNK positions counted from position 0, each chunk one
  GEMM for the scores and one for the weighted values, the chunks' sums meeting in order (cumsum,
  a sequential scan) under one max per row; a chunk outside a row's keys adds exact zeros, so the
  number of chunks does not matter. The query rows go in calls of up to CALL_ROWS GEMM rows, padded
  with zero rows to a multiple of GEMM_ROW_MULTIPLE, where the machine's GEMMs give a row the same
  bits at any such count (`attention_gemm_keeps_rows`), else in fixed tiles of ROW_TILE positions;
- elementwise exp, SiLU, sigmoid and tanh, where torch's CPU kernel runs the last elements of a call
  on a scalar path that rounds differently from the vector one (fp32 SiLU: 4% of them), which
  elements those are depending on the call's size: SiLU and sigmoid from float32 exp and correctly
  rounded arithmetic where that keeps an element's bits, else in float64, rounded once (a last-bit
  difference in float64 survives the rounding to fp32 about once in 2**29). A kernel that keeps an
  element's bits wherever it sits (`keeps_bits`, checked on the machine) runs in the input's dtype.
Norms, rope, residual adds and sampling compute each row on its own already. On CUDA the Triton
kernels take fixed shapes instead (`linear.invariant_linear`, `kernels.rms_norm`,
`kernels.paged_attention.invariant_launch`). The cost (the padding, smaller GEMMs, ops apart that
are fused otherwise) is in `docs/benchmarks.md`, and not yet small: `EngineConfig.row_invariant`
is off by default."""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from blockspec.layers.cpu_gemm import onednn_gemm, usable
from blockspec.layers.fast_path import active_kernels

ROW_TILE = 16  # rows per GEMM: a verify block of up to 16 tokens is one tile
KEY_CHUNK = 128  # key positions per attention GEMM
# Attention GEMMs, where they keep a row's bits (`attention_gemm_keeps_rows`): a multiple of
# GEMM_ROW_MULTIPLE rows (zero rows pad the rest), at most CALL_ROWS a call
GEMM_ROW_MULTIPLE = 4
CALL_ROWS = 256
CHECK_GEMM_ROWS = (4, 8, 12, 16, 36, 100, 256)  # `attention_gemm_keeps_rows`' calls: rows, and where they start
CHECK_OFFSETS = (0, 1, 3, 5)


def row_invariant() -> bool:
    """Whether row-invariant numerics are in force (`KernelConfig.row_invariant`)."""
    return active_kernels().row_invariant


def tiled_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, packed: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear(x, weight, bias), ROW_TILE rows of x a GEMM (the last tile padded with zero rows),
    on the weight's packed copy where it is usable (`cpu_gemm.usable`; a row's bits then must not
    depend on the other rows of the tile, which the tests check), the bias added after it. Each
    tile's product is a tensor of its own, concatenated (one tile: the result), not written into a
    slice of one output: a step makes a hundred such calls, and each op of one counts."""
    x2 = x.reshape(-1, x.shape[-1])
    M, N = x2.shape[0], weight.shape[0]
    copy = packed if usable(x, packed) else None
    padded = F.pad(x2, (0, 0, 0, -M % ROW_TILE))
    if padded.shape[0] == ROW_TILE:  # a decode or verify step's rows
        y = _tile_gemm(padded, weight, copy)[:M]
    else:
        y = torch.cat([_tile_gemm(tile, weight, copy) for tile in padded.split(ROW_TILE)])[:M]
    y = y if bias is None else y + bias
    return y.view(*x.shape[:-1], N)


def _tile_gemm(tile: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None) -> torch.Tensor:
    """A tile of exactly ROW_TILE rows times the weight (so never a lone row, which `cpu_gemm` pads):
    on its packed copy in the copy's dtype (one oneDNN call, the result in the tile's dtype), or by
    torch.mm."""
    if packed is None:
        return torch.mm(tile, weight.t())
    return onednn_gemm(tile.to(packed.dtype), packed).to(tile.dtype)


def silu_from_exp(x: torch.Tensor) -> torch.Tensor:
    """SiLU as x / (1 + exp(-x)): exp, then correctly rounded arithmetic."""
    return x / torch.exp(-x).add_(1)


def sigmoid_from_exp(x: torch.Tensor) -> torch.Tensor:
    """sigmoid as 1 / (1 + exp(-x)): exp, then correctly rounded arithmetic."""
    return torch.exp(-x).add_(1).reciprocal_()


# Functions with a form of float32 exp and correctly rounded arithmetic: an element's bits wherever
# exp and that arithmetic keep them (`keeps_bits` of the form), at a fraction of float64's cost
EXP_FORMS: dict[Callable, Callable[[torch.Tensor], torch.Tensor]] = {
    F.silu: silu_from_exp,
    torch.sigmoid: sigmoid_from_exp,
}


def elementwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x) of an elementwise transcendental fn (exp, SiLU, sigmoid, tanh); on the CPU under row
    invariance, unless torch's kernel keeps an element's bits in x's dtype (`keeps_bits`; see the
    module's note), by its form of float32 exp where it has one (`EXP_FORMS`) that keeps them, else
    in float64; either rounded to x's dtype once."""
    if native(fn, x):
        return fn(x)
    form = EXP_FORMS.get(fn)
    if form is not None and keeps_bits(form, torch.float32):
        return form(x.float()).to(x.dtype)
    return fn(x.double()).to(x.dtype)


def exp_(x: torch.Tensor) -> torch.Tensor:
    """x = exp(x) in place, rounded as `elementwise(torch.exp, x)` rounds it."""
    return x.exp_() if native(torch.exp, x) else x.copy_(x.double().exp_())


def native(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> bool:
    """Whether `elementwise` runs fn in x's own dtype."""
    return x.is_cuda or not row_invariant() or keeps_bits(fn, x.dtype)


_kept: dict[tuple, bool] = {}  # (fn, dtype, threads) -> what `keeps_bits` found
# `keeps_bits`' slices (offset, length) of one call over CHECK_ELEMENTS: tails of a vector, of a
# thread's share (above torch's grain of 32768 elements a call is shared) and of a whole call
CHECK_ELEMENTS = 150_001
CHECK_SLICES = ((0, 15), (1, 37), (17, 33), (5, 1000), (3, 70_001), (100, 149_800))


def keeps_bits(fn: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype) -> bool:
    """Whether torch's CPU kernel of `fn` in `dtype` gives an element the same bits wherever it sits
    in a call and whatever the call's size, at this process's threads: whether the elements past
    the vector loop (a call's last ones, or a thread's share's) take the same math. A property of
    the kernel and the CPU (exp keeps them on the EPYC measured; SiLU and sigmoid do not), not a
    promise, so checked once per function, dtype and thread count, over values from softmax's
    (down to exp's underflow) to activations'."""
    key = (fn, dtype, torch.get_num_threads())
    if key not in _kept:
        gen = torch.Generator().manual_seed(0)
        wide = torch.rand(CHECK_ELEMENTS, generator=gen) * -120  # scores less their max
        x = (torch.randn(CHECK_ELEMENTS, generator=gen) * 8).where(
            torch.rand(CHECK_ELEMENTS, generator=gen) < 0.5, wide
        )
        x = x.to(dtype)
        whole = fn(x)
        _kept[key] = all(torch.equal(fn(x[i : i + n].clone()), whole[i : i + n]) for i, n in CHECK_SLICES)
    return _kept[key]


@dataclass(frozen=True)
class RowCall:
    """One call of `tiled_attention`'s query rows: its positions, the key positions it reads (whole
    chunks), the keys each of its rows does not see, and the GEMM rows it runs at."""

    rows: slice
    keys: slice
    masked: torch.Tensor  # [1, B, n, R, 1, C]: the keys (chunk, key in it) a row (B, R) does not see
    gemm_rows: int


@dataclass(frozen=True)
class KeyPlan:
    """What `tiled_attention` takes from the block tables and key ranges alone, the same for every
    layer that reads them (a step's layers of one type): the pages to gather and the calls."""

    chunk: int
    block_tables: torch.Tensor  # [B, pages]: whole chunks, padded with the trash page 0
    calls: list[RowCall]


def key_plan(
    block_tables: torch.Tensor, k_start: torch.Tensor, k_end: torch.Tensor, page_size: int, group: int, head_dim: int
) -> KeyPlan:
    """The plan of `tiled_attention` over these keys for query heads in groups of `group` a kv head."""
    B, S = k_start.shape
    chunk = page_size * -(-KEY_CHUNK // page_size)  # fixed for the engine: whole pages
    firsts, ends = k_start.amin(dim=0).tolist(), k_end.amax(dim=0).tolist()  # per query position
    pages = max(1, -(-max(ends) // chunk)) * chunk // page_size
    table = F.pad(block_tables[:, :pages], (0, max(0, pages - block_tables.shape[1])))
    keeps = k_start.device.type == "cpu" and attention_gemm_keeps_rows(head_dim, chunk)
    positions = max(1, CALL_ROWS // group) if keeps else ROW_TILE  # query positions a call
    calls = []
    for s0 in range(0, S, positions):
        rows = slice(s0, min(s0 + positions, S))
        first = min(firsts[rows]) // chunk
        last = max(first + 1, -(-max(ends[rows]) // chunk))
        pos = torch.arange(first * chunk, last * chunk, device=k_start.device)
        visible = (pos >= k_start[:, rows, None]) & (pos < k_end[:, rows, None])  # [B, R, n * C]
        R = rows.stop - rows.start
        masked = ~visible.view(B, R, last - first, chunk).transpose(1, 2)[None, :, :, :, None, :]
        calls.append(RowCall(rows, slice(first * chunk, last * chunk), masked, gemm_rows(R * group, group, keeps)))
    return KeyPlan(chunk, table, calls)


def tiled_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    k_start: torch.Tensor,
    k_end: torch.Tensor,
    page_size: int,
    scale: float,
    sinks: torch.Tensor | None = None,
    plans: dict[tuple[int, int], KeyPlan] | None = None,
) -> torch.Tensor:
    """`attention.paged_attention_ref` (same arguments and result) in float32, each key chunk of a
    call of query rows one GEMM for the scores and one for the weighted values (CPU: its cumsum is
    a sequential scan; CUDA runs the Triton kernel's `invariant_launch` instead). The block tables
    are padded with the trash page 0 to whole chunks: the pools start zeroed and hold only computed
    K/V, so a masked key's value is finite and its zero weight adds exact zeros. Chunks past every
    row's keys (or before them) would add only such zeros, and are left out. A row with no visible
    key gives zeros. `plans`: the caller's `KeyPlan`s for these keys by (group, head size), made
    here where missing and kept there for the next layer (their host reads and masks once a step)."""
    plans = {} if plans is None else plans
    key = (q.shape[2] // k_cache.shape[1], q.shape[3])  # (group, head size)
    if key not in plans:
        plans[key] = key_plan(block_tables, k_start, k_end, page_size, *key)
    plan = plans[key]
    k, v = (gather_pages(c, plan.block_tables, page_size).float() for c in (k_cache, v_cache))  # [B, L, Hkv, D]
    if len(plan.calls) == 1 and plan.calls[0].keys.start == 0:  # one call over all the keys gathered
        return _attend_rows(q, k, v, plan.calls[0], plan.chunk, scale, sinks)
    out = torch.empty_like(q)
    for call in plan.calls:
        out[:, call.rows] = _attend_rows(
            q[:, call.rows], k[:, call.keys], v[:, call.keys], call, plan.chunk, scale, sinks
        )
    return out


def gather_pages(cache: torch.Tensor, block_tables: torch.Tensor, page_size: int) -> torch.Tensor:
    """[B, M*page_size, Hkv, D]: each sequence's pages laid end to end (index_select: on the CPU
    about three times faster than indexing with the table)."""
    pages = torch.index_select(cache.view(-1, page_size, *cache.shape[1:]), 0, block_tables.flatten())
    return pages.view(block_tables.shape[0], -1, *cache.shape[1:])


def _attend_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    call: RowCall,
    chunk: int,
    scale: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Query rows q [B, R, Hq, D] against the float32 K and V [B, L, Hkv, D] of the call's key
    positions -> [B, R, Hq, D]. A kv head's GEMM rows are its G query heads at each position
    (r = t * G + g), padded with zero rows to the call's `gemm_rows`; the softmax sees only the real
    ones. Each head's chunks are one batch of GEMM operands as gathered (rows Hkv * D apart), not
    copied."""
    B, R, Hq, D = q.shape
    Hkv, n = k.shape[2], k.shape[1] // chunk
    G, M = Hq // Hkv, call.gemm_rows
    # the rows of every chunk's GEMM, zeros past R * G (padded, then repeated for each chunk in one copy)
    qt = (q.float() * scale).view(B, R, Hkv, G, D).permute(2, 0, 1, 3, 4).reshape(Hkv, B, 1, R * G, D)
    qt = F.pad(qt, (0, 0, 0, M - R * G)).expand(Hkv, B, n, M, D).reshape(Hkv, B * n, M, D)
    p = torch.empty(Hkv, B * n, M, chunk, device=q.device)  # the scores, then in place their weights
    for q_h, k_h, p_h in zip(qt.unbind(), k.unbind(2), p.unbind()):
        attention_scores(q_h, k_h.reshape(B * n, chunk, D), out=p_h)
    scores = p.view(Hkv, B, n, M, chunk)[:, :, :, : R * G].view(Hkv, B, n, R, G, chunk)
    scores.masked_fill_(call.masked, float("-inf"))
    # A row without keys: a finite max, so its weights are exp(-inf) = 0 (its total 0, or inf with sinks)
    top = scores.amax(dim=(2, 5), keepdim=True).clamp_min_(torch.finfo(torch.float32).min)  # [Hkv, B, 1, R, G, 1]
    weights = exp_(scores.sub_(top))  # the padding rows keep their zero scores: their results are dropped
    total = weights.sum(dim=5).cumsum(dim=2)[:, :, -1]  # [Hkv, B, R, G]
    if sinks is not None:
        total = total + elementwise(torch.exp, sinks.float().view(Hkv, 1, 1, G) - top[:, :, 0, :, :, 0])
    acc = torch.empty(Hkv, B * n, M, D, device=q.device)
    for p_h, v_h, acc_h in zip(p.unbind(), v.unbind(2), acc.unbind()):
        weighted_values(p_h, v_h.reshape(B * n, chunk, D), out=acc_h)
    acc = acc.view(Hkv, B, n, M, D).cumsum(dim=2)[:, :, -1, : R * G].view(Hkv, B, R, G, D)
    out = acc / total[..., None].clamp_min(1.0)  # a total is 0 or inf (no keys: acc 0) or >= 1 (its top key)
    return out.permute(1, 2, 0, 3, 4).reshape(B, R, Hq, D).to(q.dtype)


def attention_scores(q: torch.Tensor, k: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[N, M, D] query rows times [N, C, D] keys, transposed in the GEMM -> [N, M, C]."""
    return torch.bmm(q, k.transpose(1, 2), out=out)


def weighted_values(p: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[N, M, C] weights times [N, C, D] values -> [N, M, D]."""
    return torch.bmm(p, v, out=out)


def gemm_rows(rows: int, group: int, keeps: bool) -> int:
    """The GEMM rows that a call of `rows` query rows (`group` a position) runs at: where the attention
    GEMMs keep a row's bits (`attention_gemm_keeps_rows`), its rows rounded up to a multiple of
    GEMM_ROW_MULTIPLE; else always a whole tile of ROW_TILE positions."""
    return -(-rows // GEMM_ROW_MULTIPLE) * GEMM_ROW_MULTIPLE if keeps else ROW_TILE * group


_attention_kept: dict[tuple, bool] = {}  # (head size, chunk, threads) -> what the check found


def attention_gemm_keeps_rows(head_dim: int, chunk: int) -> bool:
    """Whether torch's float32 batched GEMMs of `tiled_attention` give a row the same bits in a call of
    any multiple of GEMM_ROW_MULTIPLE rows up to CALL_ROWS, at any place in it, and in a batch of any
    size. MKL's kernels do on the EPYC measured, and not at other row counts below twelve (a row
    rounds apart at 1-3, 5-7 and 9-11 rows); a GEMM library promises none of it, so it is checked on
    the machine, once per head size, chunk and thread count. Where it fails, every call runs at the
    fixed rows of a ROW_TILE tile."""
    key = (head_dim, chunk, torch.get_num_threads())
    if key not in _attention_kept:
        gen = torch.Generator().manual_seed(0)
        total = CALL_ROWS + max(CHECK_OFFSETS)
        q = torch.randn(3, total, head_dim, generator=gen)
        k, v = torch.randn(2, 3, chunk, 2, head_dim, generator=gen)[..., 1, :]  # rows apart, as gathered
        p = torch.rand(3, total, chunk, generator=gen)
        calls = [(slice(None), slice(i, i + m)) for m in CHECK_GEMM_ROWS for i in CHECK_OFFSETS]
        calls += [(slice(0, 1), slice(3, 11)), (slice(1, 3), slice(5, 9))]  # fewer matrices in the batch
        checks = []
        for gemm, rows, keys in ((attention_scores, q, k), (weighted_values, p, v)):
            whole = gemm(rows, keys)
            checks += [torch.equal(gemm(rows[b, r], keys[b]), whole[b, r]) for b, r in calls]
        _attention_kept[key] = all(checks)
    return _attention_kept[key]
