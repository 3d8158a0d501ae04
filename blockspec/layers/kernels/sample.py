"""Drawing a token per row from softmax(logits / T) in Triton: the CUDA implementation of
`blockspec.sampling.sample_rows` (the reference: `sampling.draw` of `sampling.probs` without
filters), a plain step's sampled token and a drafter's unfiltered drafts. torch's softmax gives a
row one program, and the draw's two-level CDF is a dozen small kernels; here each row is cut into
chunks, one program each, that write their maximum and their sum of exp((x - max) / T) (an online
softmax per lane; `chunk_stats`), and a second launch takes the token at u times the row's mass,
chunk by chunk and then inside the chunk, as `sampling.draw` finds it (`draw_in_chunks`, which
DSpark's Markov chain and speculative sampling's residual draw share). The masses are float32
sums of their own order, so a token may differ from the reference's only where u falls within a
float32 rounding of a boundary between two tokens' masses."""

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

BLOCK = 1024
MAX_CHUNKS = 64
# The chunks' scan at least this wide: narrower, triton 3.6 fails to lower it for sm_90 where the
# logits' rows are 16-byte aligned (tests/test_kernels_compile.py)
MIN_PAD = 8
NONE = tl.constexpr(2**31 - 1)  # no index found (a Triton global must be a constexpr)


@triton.jit
def online_sum(best, lane_sum, x, t):
    """Each lane's sum of exp((x - max) / t) with the logits x added, from its running max `best`
    (before x) and sum `lane_sum`: an online softmax's sum (0 while a lane has seen only -inf)."""
    top = tl.maximum(best, x)
    scale = tl.where(top == float("-inf"), 0.0, tl.exp((best - top) / t))
    return lane_sum * scale + tl.where(top == float("-inf"), 0.0, tl.exp((x - top) / t))


@triton.jit
def rescaled(best, sums, m, t):
    """Sums of exp((x - best) / t) (of lanes, or of chunks) as sums of exp((x - m) / t), m their
    common max: 0 where `best` is -inf (nothing but -inf seen, or a padding chunk)."""
    return tl.where(best == float("-inf"), 0.0, sums * tl.exp((best - m) / t))


@triton.jit
def draw_in_chunks(
    x_row, mass, target, m, t, live, V, CHUNK: tl.constexpr, CHUNK_ITERS: tl.constexpr, BLOCK: tl.constexpr,
    PROBS: tl.constexpr = False,
):  # fmt: skip
    """Per sequence, the first index of positive mass whose cumulative mass exceeds `target` (u times
    the total): the chunk first, from the chunks' masses [SEQS, CHUNKS_PAD], then the token inside
    it, from the row's logits (`x_row`, [SEQS] pointers) as exp((x - m) / t), or with PROBS from
    the row's masses themselves (float32; m and t unread). A scan's sums may
    round a little apart from one place to the next, so neither is found by counting the sums
    below the target: a token of no mass (a grammar's, a ban's) is never drawn. Where rounding puts
    the target past the mass: the last chunk, and token, with any."""
    k = tl.arange(0, mass.shape[1])[None, :]
    cdf = tl.cumsum(mass, 1)
    first = tl.min(tl.where((cdf > target[:, None]) & (mass > 0), k, NONE), 1)
    chunk = tl.where(first < NONE, first, tl.max(tl.where(mass > 0, k, 0), 1))
    rest = tl.maximum(target - tl.sum(tl.where(k == chunk[:, None] - 1, cdf, 0.0), 1), 0.0)
    start = chunk * CHUNK
    running, token, last = tl.zeros_like(target), tl.full(chunk.shape, NONE, tl.int32), start
    for i in range(CHUNK_ITERS):
        v = (start + i * BLOCK)[:, None] + tl.arange(0, BLOCK)[None, :]
        inside = live[:, None] & (v < V) & (v < (start + CHUNK)[:, None])
        if PROBS:
            p = tl.load(x_row[:, None] + v, mask=inside, other=0.0)
        else:
            x = tl.load(x_row[:, None] + v, mask=inside, other=float("-inf")).to(tl.float32)
            p = tl.exp((x - m[:, None]) / t[:, None])
        sums = running[:, None] + tl.cumsum(p, 1)
        token = tl.minimum(token, tl.min(tl.where((sums > rest[:, None]) & (p > 0), v, NONE), 1))
        last = tl.maximum(last, tl.max(tl.where(p > 0, v, 0), 1))
        running = tl.max(sums, 1)  # the next block's sums go on from this one's largest
    return tl.where(token < NONE, token, last)


@triton.jit
def row_temperature(temp_ptr, seqs):
    """The temperatures of sequences `seqs`, greedy ones (T = 0) at T = 1, as `sampling.probs` has them."""
    t = tl.load(temp_ptr + seqs)
    return tl.where(t > 0, t, 1.0)


@triton.jit
def row_masses(val_ptr, sum_ptr, rows, live, t, CHUNKS: tl.constexpr, CHUNKS_PAD: tl.constexpr):
    """(max [R], chunk masses [R, CHUNKS_PAD]) of rows [R] from their chunks' maxima and sums
    (`_chunk_mass_kernel`): each chunk's sum as a sum of exp((x - max) / t) at the row's max; rows
    not `live` read nothing (-inf, no mass)."""
    k = tl.arange(0, CHUNKS_PAD)[None, :]
    ok = (k < CHUNKS) & live[:, None]
    val = tl.load(val_ptr + rows[:, None] * CHUNKS_PAD + k, mask=ok, other=float("-inf"))
    sums = tl.load(sum_ptr + rows[:, None] * CHUNKS_PAD + k, mask=ok, other=0.0)
    m = tl.max(val, 1)
    return m, rescaled(val, sums, m[:, None], t[:, None])


@triton.jit(do_not_specialize=["rows_per_t"])  # one variant for every block width
def _chunk_mass_kernel(x_ptr, temp_ptr, val_ptr, sum_ptr, V, stride_row, rows_per_t, CHUNK_ITERS: tl.constexpr,
                       CHUNKS_PAD: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row, c = tl.program_id(0), tl.program_id(1)
    t = row_temperature(temp_ptr, row // rows_per_t)
    offs = c * CHUNK_ITERS * BLOCK + tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_sum = tl.zeros([BLOCK], tl.float32)  # of exp((x - best) / t): each lane's online softmax
    x_row = x_ptr + row.to(tl.int64) * stride_row
    for i in range(CHUNK_ITERS):
        v = offs + i * BLOCK
        x = tl.load(x_row + v, mask=v < V, other=float("-inf")).to(tl.float32)
        lane_sum = online_sum(best, lane_sum, x, t)
        best = tl.maximum(best, x)
    m = tl.max(best, 0)
    tl.store(val_ptr + row * CHUNKS_PAD + c, m)
    tl.store(sum_ptr + row * CHUNKS_PAD + c, tl.sum(rescaled(best, lane_sum, m, t), 0))


@triton.jit(do_not_specialize=["rows_per_t"])
def _row_draw_kernel(x_ptr, temp_ptr, u_ptr, val_ptr, sum_ptr, out_ptr, V, stride_row, rows_per_t,
                     CHUNKS: tl.constexpr, CHUNKS_PAD: tl.constexpr, CHUNK_ITERS: tl.constexpr,
                     BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0) + tl.zeros([1], tl.int32)  # one sequence: [1] vectors for `draw_in_chunks`
    t = row_temperature(temp_ptr, row // rows_per_t)
    live = row >= 0
    m, mass = row_masses(val_ptr, sum_ptr, row, live, t, CHUNKS, CHUNKS_PAD)
    target = tl.load(u_ptr + row) * tl.sum(mass, 1).to(tl.float64)
    x_row = x_ptr + row.to(tl.int64) * stride_row
    token = draw_in_chunks(x_row, mass, target, m, t, live, V, CHUNK_ITERS * BLOCK, CHUNK_ITERS, BLOCK)
    tl.store(out_ptr + row, token.to(tl.int64))


@dataclass(frozen=True)
class ChunkLayout:
    """How a row is cut among a launch's programs (`chunk_layout`; the Markov chain's its own)."""

    chunks: int  # programs along the row
    iters: int  # BLOCKs each reads
    pad: int  # the chunks' scan width: a power of two, at least 2 (one chunk's scan fails to compile
    # for sm_90 with triton 3.6), at least MIN_PAD where the rows are logits the JIT may see aligned


def chunk_layout(V: int) -> ChunkLayout:
    """A row of V logits in up to MAX_CHUNKS chunks of whole BLOCKs, whatever the batch: a row's sums
    are then the same bits alone or beside any rows (row invariance), and one variant of each kernel
    serves every batch."""
    iters = triton.cdiv(triton.cdiv(V, min(triton.cdiv(V, BLOCK), MAX_CHUNKS)), BLOCK)
    chunks = triton.cdiv(V, iters * BLOCK)
    return ChunkLayout(chunks, iters, max(MIN_PAD, triton.next_power_of_2(chunks)))


class ChunkStats(NamedTuple):
    """Each row's chunks (`chunk_stats`): [R, layout.pad] float32 each, padding chunks unwritten."""

    layout: ChunkLayout
    maxima: torch.Tensor  # the chunk's largest logit
    sums: torch.Tensor  # its sum of exp((x - max) / T)


def chunk_stats(logits: torch.Tensor, temperature: torch.Tensor, rows_per_t: int = 1) -> ChunkStats:
    """The `chunk_layout` chunks' maxima and sums of each row of logits [R, V] (rows contiguous), row
    r at temperature[r // rows_per_t] (0: T = 1)."""
    rows, V = logits.shape
    assert V > 0 and logits.stride(-1) == 1, f"logits {tuple(logits.shape)}: rows of a vocabulary, contiguous"
    layout = chunk_layout(V)
    val = torch.empty((rows, layout.pad), dtype=torch.float32, device=logits.device)
    sums = torch.empty_like(val)
    if rows:
        _chunk_mass_kernel[(rows, layout.chunks)](
            logits, temperature, val, sums, V, logits.stride(0), rows_per_t, layout.iters, layout.pad, BLOCK
        )  # fmt: skip
    return ChunkStats(layout, val, sums)


def sample_triton(
    logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor, rows_per_t: int = 1
) -> torch.Tensor:
    """logits [R, V] (any float dtype, rows contiguous), temperature [R / rows_per_t] (0: T = 1), u
    [R] float64 uniforms -> int64 [R]: each row's token at u times its mass under softmax(logits /
    T), row r at temperature[r // rows_per_t] (a drafter's rows, rows_per_t a sequence)."""
    rows, V = logits.shape
    temperature, u = temperature.float().contiguous(), u.double().contiguous()
    stats = chunk_stats(logits, temperature, rows_per_t)
    layout = stats.layout
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        _row_draw_kernel[(rows,)](
            logits, temperature, u, stats.maxima, stats.sums, out, V, logits.stride(0), rows_per_t, layout.chunks,
            layout.pad, layout.iters, BLOCK,
        )  # fmt: skip
    return out
