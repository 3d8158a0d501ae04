"""DSpark's Markov chain on CUDA (the reference: `DSparkProposer.markov_chain`'s loop): one launch
of one kernel a block row, where the reference runs an embedding, a GEMV, casts, an add and an
argmax or a softmax and a draw a row. Row j's logits are the base logits plus markov_w2 .
markov_w1[prev_j], the bias rounded to the weights' dtype as the reference's GEMV rounds it. A
program takes a chunk of the draft vocabulary for one or more sequences (`ChainTiles`) and writes the chunk's
maximum, its first index and, when sampling, the chunk's sum of exp((x - max) / T) and its logits.
The launch of row j+1 first reduces row j's chunks to row j's draft (every program alike; the
first writes it): the argmax, or for a sampled sequence the token at u times the total mass, found
chunk by chunk and then inside the chunk, as `sampling.draw` finds it (`sample.draw_in_chunks`).
It maps the draft to its target id and reads its Markov embedding: no host sync and no grid
barrier, so the chain runs inside the step's CUDA graph. The logits left behind become q,
softmax(x / T), after the chain."""

import dataclasses
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from blockspec.layers.kernels import num_sms
from blockspec.layers.kernels.sample import ChunkLayout, draw_in_chunks, online_sum, rescaled

NO_INDEX = tl.constexpr(2**31 - 1)  # a Triton global must be a constexpr


class MarkovChain(NamedTuple):
    drafts: torch.Tensor  # [B, n] int64 target ids
    embeddings: torch.Tensor  # [B, n, r] markov_w1 of each row's previous token
    q: torch.Tensor | None  # [B, n, Vd] float32 the distributions sampled drafts are drawn from


@triton.jit
def _as_weight_dtype(x, dtype: tl.constexpr):
    """x rounded to the weights' dtype (the reference's GEMV output dtype), as float32. bfloat16 is
    rounded to nearest even by hand: Triton's interpreter truncates a cast to it."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return x.to(dtype).to(tl.float32)


@triton.jit
def _markov_row_kernel(
    base_ptr, stride_b, stride_j, w1_ptr, w2_ptr, d2t_ptr, anchor_ptr, val_ptr, idx_ptr, sum_ptr, x_ptr, temp_ptr,
    u_ptr, drafts_ptr, emb_ptr, j, n, B, Vd, R: tl.constexpr, CHUNKS: tl.constexpr,
    CHUNKS_PAD: tl.constexpr, CHUNK_ITERS: tl.constexpr, FIRST: tl.constexpr, ROW: tl.constexpr,
    HAS_D2T: tl.constexpr, SAMPLED: tl.constexpr, SEQS: tl.constexpr, BLOCK: tl.constexpr, RB: tl.constexpr,
    DOT: tl.constexpr, MMA: tl.constexpr,
):  # fmt: skip
    g, c = tl.program_id(0), tl.program_id(1)
    seq = g * SEQS + tl.arange(0, SEQS)
    live = seq < B
    t = tl.full([SEQS], 1.0, tl.float32)
    if SAMPLED:  # greedy rows (T = 0) take T = 1, as `sampling.probs` does
        t = tl.load(temp_ptr + seq, mask=live, other=0.0)
        greedy = t == 0
        t = tl.where(greedy, 1.0, t)
    if FIRST:  # the token before row 0: the anchor
        prev = tl.load(anchor_ptr + seq, mask=live, other=0).to(tl.int64)
    else:  # row j-1's draft, mapped to its target id
        k = tl.arange(0, CHUNKS_PAD)
        partial = ((seq * n + j - 1) * CHUNKS_PAD)[:, None] + k[None, :]
        ok = live[:, None] & (k < CHUNKS)[None, :]
        val = tl.load(val_ptr + partial, mask=ok, other=float("-inf"))
        idx = tl.load(idx_ptr + partial, mask=ok, other=NO_INDEX)
        m = tl.max(val, 1)
        first = ok & (val == m[:, None])
        prev = tl.min(tl.where(first, idx, NO_INDEX), 1).to(tl.int64)
        if SAMPLED:
            sums = tl.load(sum_ptr + partial, mask=ok, other=0.0)
            mass = rescaled(val, sums, m[:, None], t[:, None])  # padding chunks (val -inf): 0
            u = tl.load(u_ptr + seq * n + j - 1, mask=live, other=0.0)
            x_row = x_ptr + (seq.to(tl.int64) * n + j - 1) * Vd
            drawn = draw_in_chunks(
                x_row, mass, u * tl.sum(mass, 1), m, t, live, Vd, CHUNK_ITERS * BLOCK, CHUNK_ITERS, BLOCK
            )
            prev = tl.where(greedy, prev, drawn.to(tl.int64))
        prev = tl.where(live, prev, 0)
        if HAS_D2T:
            prev = tl.load(d2t_ptr + prev, mask=live, other=0).to(tl.int64)
        tl.store(drafts_ptr + seq * n + j - 1, prev, mask=live & (c == 0))
    if ROW:
        offs = c * CHUNK_ITERS * BLOCK + tl.arange(0, BLOCK)
        best = tl.full([SEQS, BLOCK], float("-inf"), tl.float32)
        best_idx = tl.zeros([SEQS, BLOCK], tl.int32) + offs[None, :]
        lane_sum = tl.zeros([SEQS, BLOCK], tl.float32)  # of exp((x - best) / t), a lane's online softmax
        base_rows = base_ptr + seq.to(tl.int64) * stride_b + j * stride_j
        for i in range(CHUNK_ITERS):
            v = offs + i * BLOCK
            in_vocab = v < Vd
            bias = tl.zeros([SEQS, BLOCK], tl.float32)
            for r0 in range(0, R, RB):
                r = r0 + tl.arange(0, RB)
                e_mask = live[:, None] & (r < R)[None, :]
                e = tl.load(w1_ptr + prev[:, None] * R + r[None, :], mask=e_mask, other=0.0)
                emb = emb_ptr + ((seq * n + j) * R)[:, None] + r[None, :]
                tl.store(emb, e.to(emb_ptr.dtype.element_ty), mask=e_mask & (c == 0) & (i == 0))
                w_mask = in_vocab[:, None] & (r < R)[None, :]
                w = tl.load(w2_ptr + v[:, None].to(tl.int64) * R + r[None, :], mask=w_mask, other=0.0)
                # products of 16-bit weights are exact in float32 (Triton's interpreter mishandles a bf16 dot)
                if MMA:
                    bias = tl.dot(e.to(w.dtype), tl.trans(w), bias)
                elif DOT:
                    bias = tl.dot(e.to(tl.float32), tl.trans(w.to(tl.float32)), bias, input_precision="ieee")
                else:  # fewer sequences than tl.dot's least M: multiply-adds on the CUDA cores
                    bias += tl.sum(e.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], 2)
            bias = _as_weight_dtype(bias, w2_ptr.dtype.element_ty)
            x_mask = live[:, None] & in_vocab[None, :]
            # past the vocabulary: -inf, plus a bias of zero (w2's rows there load as zeros)
            x = tl.load(base_rows[:, None] + v[None, :], mask=x_mask, other=float("-inf")).to(tl.float32) + bias
            x = tl.where(tl.abs(x) <= float("inf"), x, float("inf"))  # NaN: +inf, as torch's argmax
            take = x > best  # strictly: a lane keeps the first index of its maximum
            if SAMPLED:
                tl.store(x_ptr + (seq.to(tl.int64) * n + j)[:, None] * Vd + v[None, :], x, mask=x_mask)
                lane_sum = online_sum(best, lane_sum, x, t[:, None])
            best = tl.where(take, x, best)
            best_idx = tl.where(take, v[None, :], best_idx)
        m = tl.max(best, 1)
        out = (seq * n + j) * CHUNKS_PAD + c
        tl.store(val_ptr + out, m, mask=live)
        tl.store(idx_ptr + out, tl.min(tl.where(best == m[:, None], best_idx, NO_INDEX), 1), mask=live)
        if SAMPLED:
            tl.store(sum_ptr + out, tl.sum(rescaled(best, lane_sum, m[:, None], t[:, None]), 1), mask=live)


@dataclasses.dataclass(frozen=True)
class ChainTiles:
    """How the kernel's programs cut a row's work (`chain_tiles` picks them)."""

    seqs: int = 16  # sequences a program takes (w2 is read once for all of them); 16 and up: tl.dot
    block: int = 256  # vocabulary rows a program reads at a time
    rank_block: int = 32  # Markov rank columns a program reads at a time
    programs_per_sm: int = 8
    max_chunks: int = 256  # every program reduces the previous row's chunks: their count bounds the grid
    num_warps: int = 4
    mma: bool = False  # tl.dot on 16-bit tensor cores (exact products, fp32 sums), else in fp32 (interpretable)


def chain_tiles(B: int, w2: torch.Tensor) -> ChainTiles:
    """The H200's best over Qwen3-8B's draft vocabulary at rank 256 and SmolLM2's at rank 32: one
    sequence, a program per 64 tokens, the whole rank a load (read by many programs at once, the
    chain's bias is a memory-bound GEMV); more, up to 16 a program on tensor cores for 16-bit
    weights, so that w2 is read once for all of them (in float32 in Triton's interpreter)."""
    if B == 1:
        return ChainTiles(seqs=1, block=64, rank_block=256, programs_per_sm=64, max_chunks=2048)
    mma = w2.is_cuda and w2.dtype in (torch.bfloat16, torch.float16)
    return ChainTiles(seqs=16, block=256, rank_block=32, programs_per_sm=64, max_chunks=256, mma=mma)


def chunk_layout(groups: int, Vd: int, sms: int, tiles: ChainTiles) -> ChunkLayout:
    """Up to `programs_per_sm` programs an SM over the `groups` of sequences, each at least one
    block, the blocks shared out evenly."""
    cap = min(triton.cdiv(tiles.programs_per_sm * sms, groups), triton.cdiv(Vd, tiles.block), tiles.max_chunks)
    iters = triton.cdiv(triton.cdiv(Vd, max(1, cap)), tiles.block)
    chunks = triton.cdiv(Vd, iters * tiles.block)
    return ChunkLayout(chunks, iters, max(2, triton.next_power_of_2(chunks)))


def markov_chain(
    base: torch.Tensor,
    anchor: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    draft_to_target: torch.Tensor | None,
    embedding_dtype: torch.dtype,
    temperature: torch.Tensor | None = None,
    u: torch.Tensor | None = None,
    tiles: ChainTiles | None = None,
) -> MarkovChain:
    """base [B, n, Vd] logits, anchor [B] token ids, w1 [V, r], w2 [Vd, r]; to sample, each
    sequence's temperature [B] (0: greedy) and the uniforms of its rows [B, n]."""
    B, n, Vd = base.shape
    R = w1.shape[1]
    assert w2.shape == (Vd, R) and w1.dtype == w2.dtype, "markov_w2 must be [draft vocab, rank], in w1's dtype"
    assert w1.is_contiguous() and w2.is_contiguous() and base.stride(-1) == 1
    sampled = temperature is not None
    drafts = torch.empty(B, n, dtype=torch.int64, device=base.device)
    embeddings = torch.empty(B, n, R, dtype=embedding_dtype, device=base.device)
    x = torch.empty(B, n, Vd, dtype=torch.float32, device=base.device) if sampled else None
    if B == 0 or n == 0:
        return MarkovChain(drafts, embeddings, x)
    tiles = tiles or chain_tiles(B, w2)
    groups = triton.cdiv(B, tiles.seqs)
    layout = chunk_layout(groups, Vd, num_sms(base.device, interpreted=4), tiles)
    chunks, iters, pad = layout.chunks, layout.iters, layout.pad
    val = torch.empty(B, n, pad, dtype=torch.float32, device=base.device)
    idx = torch.empty(B, n, pad, dtype=torch.int32, device=base.device)
    if sampled:
        sums, temperature, u = torch.empty_like(val), temperature.float().contiguous(), u.float().contiguous()
    else:  # the sampling buffers are unread
        x = sums = temperature = u = val
    d2t = draft_to_target if draft_to_target is not None else anchor  # unread without HAS_D2T
    rb = max(16, min(tiles.rank_block, triton.next_power_of_2(R)))
    dot = tiles.seqs >= 16  # tl.dot's least M
    for j in range(n + 1):  # launch n reduces the last row only
        _markov_row_kernel[(groups, chunks if j < n else 1)](
            base, base.stride(0), base.stride(1), w1, w2, d2t, anchor, val, idx, sums, x, temperature, u,
            drafts, embeddings, j, n, B, Vd, R, chunks, pad, iters, j == 0, j < n,
            draft_to_target is not None, sampled, tiles.seqs, tiles.block, rb, dot, dot and tiles.mma,
            num_warps=tiles.num_warps,
        )  # fmt: skip
    if not sampled:
        return MarkovChain(drafts, embeddings, None)
    t = torch.where(temperature > 0, temperature, 1.0)[:, None, None]
    return MarkovChain(drafts, embeddings, torch.softmax(x.div_(t), -1))
