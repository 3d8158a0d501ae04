"""Speculative sampling's acceptance test and the draw after it, in Triton: the CUDA implementation of
`blockspec.sampling.sample_block` (the reference: `probs` of the target's and the drafter's logits
without filters, `sampled_accept` and `residual_tokens`), for drafts drawn from softmax(x / T) of
the drafter's logits. The reference writes both distributions out over every row of the block and
runs some forty small kernels on them; here five launches (seven with the chances):
- `sample.chunk_stats` of every target row and of every draft row: each chunk's maximum and sum of
  exp((x - max) / T), from which a row's total follows (`sample.row_masses`);
- one program a sequence tests its drafts: p(d) and q(d) as exp((x - max) / T) / total at the draft,
  draft i accepted where u_i * q(d_i) < p(d_i), up to the first rejection;
- one launch writes the residual max(p - q, 0) of the row after the accepted drafts (p itself where
  every draft was accepted), one row a sequence, with its chunks' sums, and one draws from it at
  the request's uniform (`sample.draw_in_chunks`), from p where rounding left the residual no mass
  (drawn for every sequence, a chunk's read, rather than behind a branch);
- where asked, one launch of a program per drafted row and chunk sums min(p, q) over the chunk for
  the drafts reached (the others read nothing), and torch sums the chunks: each draft's chance of
  acceptance, for the adaptive width's rates.
p and q are float32 as the reference's are, but summed in another order: a decision may differ from
the reference's only where u falls within a float32 rounding of its boundary."""

import torch
import triton
import triton.language as tl

from blockspec.layers.kernels.sample import BLOCK, chunk_stats, draw_in_chunks, row_masses, row_temperature
from blockspec.sampling import SampledBlock


@triton.jit
def _logit_at(x_ptr, rows, cols, live, V):
    """x[rows, cols] [R] of rows of V logits, float32 (-inf where not `live`)."""
    return tl.load(x_ptr + rows.to(tl.int64) * V + cols, mask=live, other=float("-inf")).to(tl.float32)


@triton.jit
def _prob(x, rows, live, val_ptr, sum_ptr, t, CHUNKS: tl.constexpr, CHUNKS_PAD: tl.constexpr):
    """softmax(row / t) at the logits x [R] of rows [R] (0 where not `live`), float32."""
    m, mass = row_masses(val_ptr, sum_ptr, rows, live, t, CHUNKS, CHUNKS_PAD)
    return tl.where(live, tl.exp((x - m) / t) / tl.sum(mass, 1), 0.0)


@triton.jit
def _same_stats(
    p_val_ptr, p_sum_ptr, p_rows, q_val_ptr, q_sum_ptr, q_rows, live, CHUNKS: tl.constexpr, CHUNKS_PAD: tl.constexpr
):
    """Whether rows p_rows [R] and q_rows [R] have the same chunk maxima and sums, bit for bit (as
    stored: not through exp); rows not `live` read nothing. Where they do and a token's two logits
    are equal, p == q there: computed apart, the two may round apart (on an H100 they do, by some
    ulps), which would let a draft of p == q be rejected and leave a residual of rounding to draw
    from."""
    k = tl.arange(0, CHUNKS_PAD)[None, :]
    ok = (k < CHUNKS) & live[:, None]
    p_at, q_at = p_rows[:, None] * CHUNKS_PAD + k, q_rows[:, None] * CHUNKS_PAD + k
    apart = (tl.load(p_val_ptr + p_at, mask=ok) != tl.load(q_val_ptr + q_at, mask=ok)) | (
        tl.load(p_sum_ptr + p_at, mask=ok) != tl.load(q_sum_ptr + q_at, mask=ok)
    )
    return tl.max(tl.where(ok & apart, 1, 0), 1) == 0


@triton.jit
def _row_pair(
    p_val_ptr, p_sum_ptr, p_rows, p_live, q_val_ptr, q_sum_ptr, q_rows, q_live, t,
    CHUNKS: tl.constexpr, CHUNKS_PAD: tl.constexpr,
):  # fmt: skip
    """(max, total) of target rows p_rows and of draft rows q_rows at temperatures t ([R] each;
    rows not live read nothing), and whether the two have the same stats (`_same_stats`)."""
    mp, p_mass = row_masses(p_val_ptr, p_sum_ptr, p_rows, p_live, t, CHUNKS, CHUNKS_PAD)
    mq, q_mass = row_masses(q_val_ptr, q_sum_ptr, q_rows, q_live, t, CHUNKS, CHUNKS_PAD)
    same = _same_stats(p_val_ptr, p_sum_ptr, p_rows, q_val_ptr, q_sum_ptr, q_rows, q_live, CHUNKS, CHUNKS_PAD)
    return mp, tl.sum(p_mass, 1), mq, tl.sum(q_mass, 1), same


@triton.jit
def _accept_kernel(
    x_ptr, y_ptr, drafts_ptr, num_ptr, temp_ptr, u_ptr, p_val_ptr, p_sum_ptr, q_val_ptr, q_sum_ptr, accepted_ptr, V, S,
    CHUNKS: tl.constexpr, CHUNKS_PAD: tl.constexpr, S_PAD: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    i = tl.arange(0, S_PAD)
    n = S - 1  # drafts a sequence
    real = i < n
    live = real & (i < tl.load(num_ptr + b))
    t = row_temperature(temp_ptr, b + tl.zeros([S_PAD], tl.int32))
    d = tl.load(drafts_ptr + b * n + i, mask=real, other=0)
    p_rows, q_rows = b * S + i, b * n + i
    x_d, y_d = _logit_at(x_ptr, p_rows, d, real, V), _logit_at(y_ptr, q_rows, d, real, V)
    p = _prob(x_d, p_rows, real, p_val_ptr, p_sum_ptr, t, CHUNKS, CHUNKS_PAD)
    q = _prob(y_d, q_rows, real, q_val_ptr, q_sum_ptr, t, CHUNKS, CHUNKS_PAD)
    same = (x_d == y_d) & _same_stats(
        p_val_ptr, p_sum_ptr, p_rows, q_val_ptr, q_sum_ptr, q_rows, real, CHUNKS, CHUNKS_PAD
    )
    q = tl.where(same, p, q)  # equal inputs, equal probabilities (`_same_stats`)
    u = tl.load(u_ptr + b * n + i, mask=real, other=1.0)
    hit = live & (u * q.to(tl.float64) < p.to(tl.float64))
    tl.store(accepted_ptr + b, tl.min(tl.where(hit, S_PAD, i), 0).to(tl.int64))  # the first draft rejected


@triton.jit
def _residual_mass_kernel(
    x_ptr, y_ptr, num_ptr, temp_ptr, accepted_ptr, p_val_ptr, p_sum_ptr, q_val_ptr, q_sum_ptr, r_ptr, rsum_ptr, V, S,
    CHUNKS: tl.constexpr, CHUNKS_PAD: tl.constexpr, CHUNK_ITERS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    b, c = tl.program_id(0), tl.program_id(1)
    seq = b + tl.zeros([1], tl.int32)
    a = tl.load(accepted_ptr + seq).to(tl.int32)
    rejected = a < tl.load(num_ptr + seq)
    t = row_temperature(temp_ptr, seq)
    p_row = seq * S + a
    q_row = seq * (S - 1) + tl.minimum(a, S - 2)
    mp, zp, mq, zq, same_rows = _row_pair(
        p_val_ptr, p_sum_ptr, p_row, seq >= 0, q_val_ptr, q_sum_ptr, q_row, rejected, t, CHUNKS, CHUNKS_PAD
    )  # fmt: skip
    v = c * CHUNK_ITERS * BLOCK + tl.arange(0, BLOCK)[None, :]
    total = tl.zeros([1, BLOCK], tl.float32)
    for _ in range(CHUNK_ITERS):
        ok = v < V
        x = tl.load(x_ptr + p_row.to(tl.int64)[:, None] * V + v, mask=ok, other=float("-inf")).to(tl.float32)
        y = tl.load(y_ptr + q_row.to(tl.int64)[:, None] * V + v, mask=ok & rejected[:, None], other=float("-inf"))
        y = y.to(tl.float32)
        p = tl.exp((x - mp[:, None]) / t[:, None]) / zp[:, None]
        q = tl.exp((y - mq[:, None]) / t[:, None]) / zq[:, None]
        same = (x == y) & same_rows[:, None]  # p == q: no residual (`_same_stats`)
        r = tl.where(rejected[:, None], tl.where(same, 0.0, tl.maximum(p - q, 0.0)), p)
        tl.store(r_ptr + seq.to(tl.int64)[:, None] * V + v, r, mask=ok)
        total += tl.where(ok, r, 0.0)
        v += BLOCK
    tl.store(rsum_ptr + seq * CHUNKS_PAD + c, tl.sum(total, 1))


@triton.jit
def _chance_kernel(
    x_ptr, y_ptr, num_ptr, temp_ptr, accepted_ptr, p_val_ptr, p_sum_ptr, q_val_ptr, q_sum_ptr, part_ptr, V, S,
    CHUNKS: tl.constexpr, CHUNKS_PAD: tl.constexpr, CHUNK_ITERS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    r, c = tl.program_id(0), tl.program_id(1)  # a draft row of the block, a chunk of its vocabulary
    row = r + tl.zeros([1], tl.int32)
    seq, i = row // (S - 1), row % (S - 1)
    reached = (i <= tl.load(accepted_ptr + seq)) & (i < tl.load(num_ptr + seq))
    t = row_temperature(temp_ptr, seq)
    p_row = seq * S + i
    mp, zp, mq, zq, same_rows = _row_pair(
        p_val_ptr, p_sum_ptr, p_row, reached, q_val_ptr, q_sum_ptr, row, reached, t, CHUNKS, CHUNKS_PAD
    )  # fmt: skip
    v = c * CHUNK_ITERS * BLOCK + tl.arange(0, BLOCK)[None, :]
    total = tl.zeros([1, BLOCK], tl.float32)
    for _ in range(CHUNK_ITERS):
        ok = (v < V) & reached[:, None]
        x = tl.load(x_ptr + p_row.to(tl.int64)[:, None] * V + v, mask=ok, other=float("-inf")).to(tl.float32)
        y = tl.load(y_ptr + row.to(tl.int64)[:, None] * V + v, mask=ok, other=float("-inf")).to(tl.float32)
        p = tl.exp((x - mp[:, None]) / t[:, None]) / zp[:, None]
        q = tl.exp((y - mq[:, None]) / t[:, None]) / zq[:, None]
        total += tl.where(ok, tl.where((x == y) & same_rows[:, None], p, tl.minimum(p, q)), 0.0)
        v += BLOCK
    tl.store(part_ptr + row * CHUNKS + c, tl.sum(total, 1))


@triton.jit
def _residual_draw_kernel(
    x_ptr, temp_ptr, u_ptr, accepted_ptr, p_val_ptr, p_sum_ptr, r_ptr, rsum_ptr, token_ptr, V, S,
    CHUNKS: tl.constexpr, CHUNKS_PAD: tl.constexpr, CHUNK_ITERS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0) + tl.zeros([1], tl.int32)  # one sequence: [1] vectors for `draw_in_chunks`
    live = seq >= 0
    a = tl.load(accepted_ptr + seq).to(tl.int32)
    t = row_temperature(temp_ptr, seq)
    u = tl.load(u_ptr + seq * S + a)
    k = tl.arange(0, CHUNKS_PAD)[None, :]
    r_mass = tl.load(rsum_ptr + seq[:, None] * CHUNKS_PAD + k, mask=k < CHUNKS, other=0.0)
    r_total = tl.sum(r_mass, 1)
    r_row = r_ptr + seq.to(tl.int64) * V
    token = draw_in_chunks(
        r_row, r_mass, u * r_total.to(tl.float64), t, t, live, V, CHUNK_ITERS * BLOCK, CHUNK_ITERS, BLOCK, PROBS=True
    )  # fmt: skip  (its m and t unread: masses)
    # max(p - q, 0) is all zero only where p == q (a rejection of probability 0): then from p
    p_row = seq * S + a
    mp, p_mass = row_masses(p_val_ptr, p_sum_ptr, p_row, live, t, CHUNKS, CHUNKS_PAD)
    x_row = x_ptr + p_row.to(tl.int64) * V
    from_p = draw_in_chunks(x_row, p_mass, u * tl.sum(p_mass, 1).to(tl.float64), mp, t, live, V,
                            CHUNK_ITERS * BLOCK, CHUNK_ITERS, BLOCK)  # fmt: skip
    tl.store(token_ptr + seq, tl.where(r_total > 0, token, from_p).to(tl.int64))


def speculative_sample_triton(
    logits: torch.Tensor,
    draft_logits: torch.Tensor,
    drafts: torch.Tensor,
    num_drafts: torch.Tensor,
    temperature: torch.Tensor,
    u_accept: torch.Tensor,
    u_residual: torch.Tensor,
    imposed: torch.Tensor | None = None,
    chances: bool = False,
) -> SampledBlock:
    """logits [B, S, V] the target's, draft_logits [B, S-1, V] the drafter's (any float dtype),
    drafts [B, S-1], num_drafts [B], temperature [B] (0: T = 1), u_accept [B, S-1] and u_residual
    [B, S] float64 uniforms (the draw after j accepted drafts at u_residual[:, j]) -> the accepted
    drafts and the token after them, int64 [B] each, and with `chances` the drafts' chances of
    acceptance, float32 [B, S-1] (0 past the drafts reached). `imposed` [B]: counts that replace the
    test's (which still runs: a simulated step costs what a real one does)."""
    B, S, V = logits.shape
    assert S >= 2 and draft_logits.shape == (B, S - 1, V), (
        f"logits {tuple(logits.shape)}, drafts' {tuple(draft_logits.shape)}"
    )
    x, y = logits.reshape(B * S, V).contiguous(), draft_logits.reshape(B * (S - 1), V).contiguous()
    temperature = temperature.float().contiguous()
    p_stats = chunk_stats(x, temperature, S)  # each target row's chunks
    q_stats = chunk_stats(y, temperature, S - 1)  # each draft row's
    layout = p_stats.layout
    stats = (p_stats.maxima, p_stats.sums, q_stats.maxima, q_stats.sums)
    drafts, num_drafts = drafts.contiguous(), num_drafts.contiguous()
    accepted = torch.empty(B, dtype=torch.int64, device=logits.device)
    token = torch.empty_like(accepted)
    if B == 0:
        return SampledBlock(accepted, token, torch.zeros(B, S - 1, device=logits.device) if chances else None)
    shape = {"CHUNKS": layout.chunks, "CHUNKS_PAD": layout.pad}
    u_accept, u_residual = u_accept.double().contiguous(), u_residual.double().contiguous()
    _accept_kernel[(B,)](
        x, y, drafts, num_drafts, temperature, u_accept, *stats, accepted, V, S, **shape,
        S_PAD=triton.next_power_of_2(S),
    )  # fmt: skip
    if imposed is not None:
        accepted = imposed.to(torch.int64).contiguous()
    residual = torch.empty((B, V), dtype=torch.float32, device=logits.device)
    r_sum = torch.empty((B, layout.pad), dtype=torch.float32, device=logits.device)
    steps = {"CHUNK_ITERS": layout.iters, "BLOCK": BLOCK}
    _residual_mass_kernel[(B, layout.chunks)](
        x, y, num_drafts, temperature, accepted, *stats, residual, r_sum, V, S, **shape, **steps
    )  # fmt: skip
    _residual_draw_kernel[(B,)](
        x, temperature, u_residual, accepted, *stats[:2], residual, r_sum, token, V, S, **shape, **steps
    )  # fmt: skip
    if not chances:
        return SampledBlock(accepted, token)
    part = torch.empty((B * (S - 1), layout.chunks), dtype=torch.float32, device=logits.device)
    _chance_kernel[(B * (S - 1), layout.chunks)](
        x, y, num_drafts, temperature, accepted, *stats, part, V, S, **shape, **steps
    )  # fmt: skip
    return SampledBlock(accepted, token, part.sum(1).view(B, S - 1))
