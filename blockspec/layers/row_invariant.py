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
- attention: the query rows in tiles of ROW_TILE and the keys in chunks of KEY_CHUNK positions
  counted from position 0, each (tile, chunk) one fixed-shape GEMM for the scores and one for the
  weighted values; the chunks' sums meet in order (cumsum, a sequential scan) under one max per
  row, and a chunk past a row's keys adds exact zeros, so the number of chunks does not matter;
- elementwise exp, SiLU, sigmoid and tanh in float64, rounded once, where torch's CPU kernel runs
  the last elements of a call on a scalar path that rounds differently from the vector one (fp32
  SiLU: 4% of them), which elements those are depending on the call's size; a last-bit
  difference in float64 survives the rounding to fp32 about once in 2**29. A kernel that keeps
  an element's bits wherever it sits (`keeps_bits`, checked on the machine) runs in the input's
  dtype.
Norms, rope, residual adds and sampling compute each row on its own already. On CUDA the Triton
kernels take fixed shapes instead (`linear.invariant_linear`, `kernels.rms_norm`,
`kernels.paged_attention.invariant_launch`). The cost (the padding, smaller GEMMs, ops apart that
are fused otherwise) is in `docs/benchmarks.md`, and not yet small: `EngineConfig.row_invariant`
is off by default."""

from collections.abc import Callable

import torch
import torch.nn.functional as F

from blockspec.layers.cpu_gemm import packed_linear, usable
from blockspec.layers.fast_path import active_kernels

ROW_TILE = 16  # rows per GEMM: a verify block of up to 16 tokens is one tile
KEY_CHUNK = 128  # key positions per attention GEMM
CONTIGUOUS = torch.contiguous_format  # a permuted view converted in one copy, laid out as the GEMM reads it


def row_invariant() -> bool:
    """Whether row-invariant numerics are in force (`KernelConfig.row_invariant`)."""
    return active_kernels().row_invariant


def tiled_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, packed: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear(x, weight, bias), ROW_TILE rows of x a GEMM (the last tile padded with zero rows),
    on the weight's packed copy where it is usable (`cpu_gemm.usable`; a row's bits then must not
    depend on the other rows of the tile, which the tests check), the bias added after it."""
    x2 = x.reshape(-1, x.shape[-1])
    M, N = x2.shape[0], weight.shape[0]
    padded = F.pad(x2, (0, 0, 0, -M % ROW_TILE))
    copy = packed if usable(x, packed) else None
    y = torch.empty((padded.shape[0], N), dtype=x.dtype, device=x.device)
    for start in range(0, padded.shape[0], ROW_TILE):
        tile = padded[start : start + ROW_TILE]
        if copy is None:
            torch.mm(tile, weight.t(), out=y[start : start + ROW_TILE])
        else:
            y[start : start + ROW_TILE] = packed_linear(tile, copy, None)
    y = y[:M] if bias is None else y[:M] + bias
    return y.view(*x.shape[:-1], N)


def elementwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x) of an elementwise transcendental fn (exp, SiLU, sigmoid, tanh); on the CPU under row
    invariance in float64, rounded once, unless torch's kernel keeps an element's bits in x's
    dtype (`keeps_bits`; see the module's note)."""
    if x.is_cuda or not row_invariant() or keeps_bits(fn, x.dtype):
        return fn(x)
    return fn(x.double()).to(x.dtype)


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
) -> torch.Tensor:
    """`attention.paged_attention_ref` (same arguments and result) in float32, one query tile and
    key chunk a GEMM (CPU: its cumsum is a sequential scan; CUDA runs the Triton kernel's
    `invariant_launch` instead). The block tables are padded with the trash page 0 to whole chunks: the pools
    start zeroed and hold only computed K/V, so a masked key's value is finite and its zero weight
    adds exact zeros. A row with no visible key gives zeros."""
    B, S, _, D = q.shape
    chunk = page_size * -(-KEY_CHUNK // page_size)  # fixed for the engine: whole pages
    pages = -(-block_tables.shape[1] * page_size // chunk) * chunk // page_size
    block_tables = F.pad(block_tables, (0, pages - block_tables.shape[1]))
    k, v = (gather_pages(c, block_tables, page_size) for c in (k_cache, v_cache))  # [B, Lp, Hkv, D]
    chunks, Hkv = k.shape[1] // chunk, k.shape[2]
    # [B, Hkv, chunks, D, C] and [B, Hkv, chunks, C, D]: a chunk is the last two dims
    kc = k.view(B, chunks, chunk, Hkv, D).permute(0, 3, 1, 4, 2).to(torch.float32, memory_format=CONTIGUOUS)
    vc = v.view(B, chunks, chunk, Hkv, D).permute(0, 3, 1, 2, 4).to(torch.float32, memory_format=CONTIGUOUS)
    pos = torch.arange(chunks * chunk, device=q.device)
    out = torch.empty_like(q)
    for s0 in range(0, S, ROW_TILE):
        rows = slice(s0, min(s0 + ROW_TILE, S))
        visible = (pos >= k_start[:, rows, None]) & (pos < k_end[:, rows, None])  # [B, R, Lp]
        out[:, rows] = _attend_tile(q[:, rows], kc, vc, visible, scale, sinks)
    return out


def gather_pages(cache: torch.Tensor, block_tables: torch.Tensor, page_size: int) -> torch.Tensor:
    """[B, M*page_size, Hkv, D]: each sequence's pages laid end to end (index_select: on the CPU
    about three times faster than indexing with the table)."""
    pages = torch.index_select(cache.view(-1, page_size, *cache.shape[1:]), 0, block_tables.flatten())
    return pages.view(block_tables.shape[0], -1, *cache.shape[1:])


def _attend_tile(
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """One query tile q [B, R <= ROW_TILE, Hq, D] against the key chunks (`tiled_attention`) ->
    [B, R, Hq, D]. A kv head's GEMM rows are its G query heads at each of the ROW_TILE positions
    (the tile padded; r = t * G + g); the softmax sees only the R real positions."""
    B, R, Hq, D = q.shape
    Hkv, chunks, chunk = kc.shape[1], kc.shape[2], kc.shape[4]
    G = Hq // Hkv
    qt = F.pad(q.float() * scale, (0, 0, 0, 0, 0, ROW_TILE - R)).view(B, ROW_TILE, Hkv, G, D)
    qt = qt.permute(0, 2, 1, 3, 4).reshape(B, Hkv, 1, ROW_TILE * G, D)
    scores = (qt @ kc)[..., : R * G, :].view(B, Hkv, chunks, R, G, chunk)
    hidden = ~visible.view(B, R, chunks, chunk).transpose(1, 2)[:, None, :, :, None, :]  # [B, 1, chunks, R, 1, C]
    scores = scores.masked_fill(hidden, float("-inf"))
    top = scores.amax(dim=(2, 5), keepdim=True)  # [B, Hkv, 1, R, G, 1]
    top = torch.where(top == float("-inf"), 0.0, top)  # rows without keys
    p = elementwise(torch.exp, scores - top)
    total = p.sum(dim=5).cumsum(dim=2)[:, :, -1]  # [B, Hkv, R, G]
    if sinks is not None:
        sink = sinks.float().view(1, Hkv, 1, G)
        total = total + elementwise(torch.exp, sink - top[:, :, 0, :, :, 0])
    p = F.pad(p.view(B, Hkv, chunks, R * G, chunk), (0, 0, 0, (ROW_TILE - R) * G))
    acc = (p @ vc).cumsum(dim=2)[:, :, -1, : R * G].view(B, Hkv, R, G, D)
    out = torch.where(total[..., None] > 0, acc / total[..., None], 0.0)
    return out.permute(0, 2, 1, 3, 4).reshape(B, R, Hq, D).to(q.dtype)
