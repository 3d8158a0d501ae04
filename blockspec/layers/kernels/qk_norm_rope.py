"""Per-head RMSNorm + rotary embedding of the q and k heads of a fused q|k|v projection, in place,
in Triton: the CUDA implementation of `blockspec.layers.rotary.qk_norm_rope` (reference:
`qk_norm_rope_ref`). One launch per layer, program (token, head) for the Hq + Hkv q and k heads;
the v heads are not touched. Computed in fp32 and rounded once, except that the normed row is
rounded to the activation dtype before the norm weight multiplies it, as the reference does."""

import torch
import triton
import triton.language as tl


@triton.jit
def _qk_norm_rope_kernel(
    qkv_ptr,
    q_weight_ptr,
    k_weight_ptr,
    cos_ptr,
    sin_ptr,
    stride_t,
    stride_h,
    stride_cos,
    eps,
    NUM_HEADS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HALF: tl.constexpr,  # head_dim // 2
    BLOCK: tl.constexpr,  # HALF padded to a power of two
):
    t = tl.program_id(0).to(tl.int64)  # t * stride_t may pass 2**31 in long prefills
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    row = qkv_ptr + t * stride_t + h * stride_h
    x1 = tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(row + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_WEIGHT:
        r = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * HALF) + eps)
        is_q = h < NUM_HEADS  # both weights are loaded (a few hundred bytes, cached), one is kept
        w1 = tl.where(is_q, tl.load(q_weight_ptr + offs, mask=mask), tl.load(k_weight_ptr + offs, mask=mask))
        w2 = tl.where(
            is_q, tl.load(q_weight_ptr + HALF + offs, mask=mask), tl.load(k_weight_ptr + HALF + offs, mask=mask)
        )
        dtype = qkv_ptr.dtype.element_ty
        x1 = (x1 * r).to(dtype).to(tl.float32) * w1.to(tl.float32)
        x2 = (x2 * r).to(dtype).to(tl.float32) * w2.to(tl.float32)
    cos = cos_ptr + t * stride_cos
    sin = sin_ptr + t * stride_cos
    c1 = tl.load(cos + offs, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin + offs, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(row + offs, (x1 * c1 - x2 * s1).to(qkv_ptr.dtype.element_ty), mask=mask)
    tl.store(row + HALF + offs, (x2 * c2 + x1 * s2).to(qkv_ptr.dtype.element_ty), mask=mask)


def qk_norm_rope_triton(
    qkv: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """qkv [..., Hq + 2*Hkv, D] (rows of heads contiguous), cos/sin [..., D]: rotates (and norms,
    with weights) the q and k heads of qkv in place; returns qkv."""
    d = qkv.shape[-1]
    rows = qkv.reshape(-1, qkv.shape[-2], d)  # a view: the model's qkv is contiguous
    cos2, sin2 = cos.reshape(-1, d), sin.reshape(-1, d)
    assert qkv.shape[-2] == num_heads + 2 * num_kv_heads, f"{qkv.shape[-2]} heads, not {num_heads} + 2 * {num_kv_heads}"
    assert (q_weight is None) == (k_weight is None), "q and k norm weights come together"
    assert rows.data_ptr() == qkv.data_ptr() and rows.stride(2) == 1 and d % 2 == 0
    assert cos2.shape[0] == rows.shape[0] and cos2.stride() == sin2.stride() and cos2.stride(1) == 1
    has_weight = q_weight is not None
    if rows.shape[0]:
        _qk_norm_rope_kernel[(rows.shape[0], num_heads + num_kv_heads)](
            rows,
            q_weight if has_weight else cos2,  # never read without weights
            k_weight if has_weight else cos2,
            cos2,
            sin2,
            rows.stride(0),
            rows.stride(1),
            cos2.stride(0),
            eps,
            NUM_HEADS=num_heads,
            HAS_WEIGHT=has_weight,
            HALF=d // 2,
            BLOCK=triton.next_power_of_2(d // 2),
        )
    return qkv
