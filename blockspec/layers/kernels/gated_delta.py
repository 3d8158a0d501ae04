"""The gated delta rule's recurrence on states kept in a slot-indexed pool: the CUDA implementation
of `blockspec.layers.gated_deltanet.gated_delta_rule_in_slots` for a few rows a sequence (decode,
verify, the rollback's replay, short prompts). Program (v-block, sequence x value head) reads its
state tile from the pool at the sequence's slot (zero where it starts at position 0), advances it
row by row (rows past the sequence's count leave it as it is) and, where asked, stores it back at
the slot: no gather of the states before, no scatter after, no masked copies of the gates. q, k
and v are read through their strides (views of the convolution's output); q and k are L2-normed
here."""

import torch
import triton
import triton.language as tl

BLOCK_V = 8  # value columns a program holds: a [key_dim, 8] fp32 tile, one warp (as fla's recurrent kernel)


@triton.jit
def _row(p_q, p_k, p_v, p_g, p_beta, t, T, n, mask_k, mask_v, OUTPUTS: tl.constexpr):
    """Row t's q (zeros without OUTPUTS), k, v, g and beta in fp32; g and beta zero past the
    sequence's n rows (the state stays), everything zero past the block's T."""
    there, live = t < T, t < n
    q = tl.zeros(mask_k.shape, tl.float32)
    if OUTPUTS:
        q = tl.load(p_q, mask=mask_k & there, other=0.0).to(tl.float32)
    k = tl.load(p_k, mask=mask_k & there, other=0.0).to(tl.float32)
    v = tl.load(p_v, mask=mask_v & there, other=0.0).to(tl.float32)
    g = tl.load(p_g, mask=live & there, other=0.0).to(tl.float32)
    beta = tl.load(p_beta, mask=live & there, other=0.0).to(tl.float32)
    return q, k, v, g, beta


# no variant per stride or row count: the launch-ahead path passes strided `starts`, prompts any T
@triton.jit(do_not_specialize=[
    "s_slots", "s_starts", "s_rows", "T", "sq_b", "sq_t", "sq_c", "sk_b", "sk_t", "sk_c", "sv_b", "sv_t", "sv_c",
])  # fmt: skip
def _recurrent_kernel(
    q, k, v, g, beta, o, pool, row_states, slots, starts, rows, s_slots, s_starts, s_rows,
    T, sq_b, sq_t, sq_c, sk_b, sk_t, sk_c, sv_b, sv_t, sv_c, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    OUTPUTS: tl.constexpr, WRITE: tl.constexpr, ROW_STATES: tl.constexpr,
):  # fmt: skip
    i_v, i_nh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    slot, n = tl.load(slots + i_n * s_slots).to(tl.int64), tl.load(rows + i_n * s_rows)
    carried = tl.load(starts + i_n * s_starts) != 0  # a sequence at position 0 starts from the zero state
    o_k, o_v = tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    mask_k, mask_v = o_k < K, o_v < V
    mask_h = mask_k[:, None] & mask_v[None, :]
    tile = i_hv * K * V + o_k[:, None] * V + o_v[None, :]
    h = tl.load(pool + slot * HV * K * V + tile, mask=mask_h & carried, other=0.0).to(tl.float32)
    p_q = q + i_n * sq_b + (i_h * K + o_k) * sq_c
    p_k = k + i_n * sk_b + (i_h * K + o_k) * sk_c
    p_v = v + i_n * sv_b + (i_hv * V + o_v) * sv_c
    p_g = i_n * T * HV + i_hv  # g's and beta's offset
    p_o = o + p_g * V + o_v
    # Row t + 1 is loaded before row t is computed: its loads' latency hides behind that work
    b_q, b_k, b_v, b_g, b_beta = _row(p_q, p_k, p_v, g + p_g, beta + p_g, 0, T, n, mask_k, mask_v, OUTPUTS)
    last = T if OUTPUTS else n  # without outputs, only the rows that move the state
    t = T * 0  # a while loop: Triton's interpreter cannot range over a runtime argument
    while t < last:
        nxt = t + 1
        n_q, n_k, n_v, n_g, n_beta = _row(
            p_q + nxt * sq_t, p_k + nxt * sk_t, p_v + nxt * sv_t, g + p_g + nxt * HV, beta + p_g + nxt * HV,
            nxt, T, n, mask_k, mask_v, OUTPUTS,
        )  # fmt: skip
        b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)
        h *= tl.exp(b_g)
        delta = (b_v - tl.sum(h * b_k[:, None], 0)) * b_beta
        h += b_k[:, None] * delta[None, :]
        if OUTPUTS:
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + 1e-6) * scale
            tl.store(p_o + t * HV * V, tl.sum(h * b_q[:, None], 0).to(o.dtype.element_ty), mask=mask_v)
        if ROW_STATES:
            tl.store(row_states + ((i_n * T + t) * HV) * K * V + tile, h, mask=mask_h)
        b_q, b_k, b_v, b_g, b_beta = n_q, n_k, n_v, n_g, n_beta
        t = nxt
    if WRITE:
        tl.store(pool + slot * HV * K * V + tile, h, mask=mask_h)


def recurrent_in_slots(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
    rows: torch.Tensor,
    outputs: bool = True,
    write: bool = False,
    row_states: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """q, k [B, T, Hk, Dk], v [B, T, Hv, Dv] (any strides whose last dim is a view of channels
    h * D + d); g fp32, beta [B, T, Hv] contiguous; pool [slots, Hv, Dk, Dv] fp32; slots, starts,
    rows [B] int64. Each sequence's state from pool[slots[b]] (zero where starts[b] == 0), advanced
    over its first rows[b] rows; with `write`, stored back there. Returns the outputs of every row
    [B, T, Hv, Dv] in v's dtype (None without `outputs`). `row_states` [B, T, Hv, Dk, Dv] fp32, with
    `outputs`: the state after each row stored there too (the per-row alternative to the rollback's
    replay, timed by `blockspec.bench.rollback_bench`)."""
    B, T, H, K = k.shape
    HV, V = v.shape[2:]
    assert g.is_contiguous() and beta.is_contiguous() and g.shape == beta.shape == (B, T, HV)
    assert pool.is_contiguous() and pool.dtype == torch.float32 and pool.shape[1:] == (HV, K, V)
    assert all(x.stride(2) == x.shape[3] * x.stride(3) for x in (q, k, v)), "heads x dims must be one channel axis"
    assert slots.shape == starts.shape == rows.shape == (B,)
    o = torch.empty(B, T, HV, V, dtype=v.dtype, device=v.device) if outputs else None
    BV = min(BLOCK_V, triton.next_power_of_2(V))
    _recurrent_kernel[(triton.cdiv(V, BV), B * HV)](
        q, k, v, g, beta, o if outputs else v, pool, row_states if row_states is not None else pool,
        slots, starts, rows, slots.stride(0), starts.stride(0), rows.stride(0), T,
        q.stride(0), q.stride(1), q.stride(3), k.stride(0), k.stride(1), k.stride(3), v.stride(0), v.stride(1),
        v.stride(3), K**-0.5,
        H=H, HV=HV, K=K, V=V, BK=triton.next_power_of_2(K), BV=BV,
        OUTPUTS=outputs, WRITE=write, ROW_STATES=row_states is not None, num_warps=1,
    )  # fmt: skip
    return o
