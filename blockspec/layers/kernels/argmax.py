"""Argmax over the vocabulary in Triton: the CUDA implementation of `blockspec.sampling.argmax`
(the reference: torch's argmax, the first index of the maximum). torch reduces a row in one
program, so a verify's few rows of a large vocabulary run on as few SMs. Here each row is cut
into chunks, one program each, that write their maximum and its first index; a second launch
picks the first chunk holding the row's maximum. NaN counts as +inf (torch puts NaN above
everything; the two differ only where a row holds both NaN and +inf)."""

import torch
import triton
import triton.language as tl

from blockspec.layers.kernels import num_sms

DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # compared in float32: wider floats could tie wrongly
BLOCK = 2048
PROGRAMS_PER_SM = 16
MAX_CHUNKS = 256


@triton.jit
def _chunk_argmax_kernel(
    x_ptr, val_ptr, idx_ptr, V, stride_row, CHUNK_ITERS: tl.constexpr, CHUNKS_PAD: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    row, c = tl.program_id(0), tl.program_id(1)
    offs = c * CHUNK_ITERS * BLOCK + tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = offs  # each lane's first element: a row of -inf gives index 0
    x_row = x_ptr + row.to(tl.int64) * stride_row
    for i in range(CHUNK_ITERS):
        idx = offs + i * BLOCK
        v = tl.load(x_row + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        v = tl.where(tl.abs(v) <= float("inf"), v, float("inf"))  # NaN: +inf
        take = v > best  # strictly: a lane keeps the first index of its maximum
        best = tl.where(take, v, best)
        best_idx = tl.where(take, idx, best_idx)
    m = tl.max(best, 0)
    tl.store(val_ptr + row * CHUNKS_PAD + c, m)
    tl.store(idx_ptr + row * CHUNKS_PAD + c, tl.min(tl.where(best == m, best_idx, 2**31 - 1), 0))


@triton.jit
def _row_argmax_kernel(val_ptr, idx_ptr, out_ptr, CHUNKS: tl.constexpr, CHUNKS_PAD: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, CHUNKS_PAD)
    ok = c < CHUNKS
    val = tl.load(val_ptr + row * CHUNKS_PAD + c, mask=ok, other=float("-inf"))
    idx = tl.load(idx_ptr + row * CHUNKS_PAD + c, mask=ok, other=2**31 - 1)
    m = tl.max(val, 0)
    tl.store(out_ptr + row, tl.min(tl.where(ok & (val == m), idx, 2**31 - 1), 0).to(tl.int64))


def chunk_iters(rows: int, V: int, sms: int) -> int:
    """BLOCKs a program reads: a row cut into `num_chunks` chunks, rounded up to whole BLOCKs."""
    return triton.cdiv(triton.cdiv(V, num_chunks(rows, V, sms)), BLOCK)


def num_chunks(rows: int, V: int, sms: int) -> int:
    """Chunks a row: up to PROGRAMS_PER_SM programs an SM, each at least one BLOCK of the row. A
    program's loads go one BLOCK after the other, so few rows read best in chunks of one BLOCK."""
    return max(1, min(triton.cdiv(PROGRAMS_PER_SM * sms, rows), triton.cdiv(V, BLOCK), MAX_CHUNKS))


def argmax_triton(x: torch.Tensor) -> torch.Tensor:
    """x [..., V] (bf16, fp16 or fp32) -> int64 [...]: the first index of each row's maximum."""
    V = x.shape[-1]
    assert V > 0, "argmax of an empty row"
    assert x.dtype in DTYPES, f"{x.dtype}: compared in float32"
    x2 = x.reshape(-1, V) if x.stride(-1) == 1 else x.contiguous().reshape(-1, V)
    rows = x2.shape[0]
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out.view(x.shape[:-1])
    iters = chunk_iters(rows, V, num_sms(x.device, interpreted=4))
    chunks = triton.cdiv(V, iters * BLOCK)
    pad = triton.next_power_of_2(chunks)
    val = torch.empty((rows, pad), dtype=torch.float32, device=x.device)
    idx = torch.empty((rows, pad), dtype=torch.int32, device=x.device)
    _chunk_argmax_kernel[(rows, chunks)](x2, val, idx, V, x2.stride(0), iters, pad, BLOCK, num_warps=4)
    _row_argmax_kernel[(rows,)](val, idx, out, chunks, pad, num_warps=1)
    return out.view(x.shape[:-1])
