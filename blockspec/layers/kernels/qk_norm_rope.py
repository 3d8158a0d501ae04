"""Per-head RMSNorm + rotary embedding of the q and k heads of a fused q|k|v projection, in place,
in Triton: the CUDA implementation of `blockspec.layers.rotary.qk_norm_rope` (reference:
`qk_norm_rope_ref`, its cache write `blockspec.layers.kv_write.write_kv`). One launch per layer,
program (token, head) for the Hq + Hkv q and k heads; the v heads are not touched. Computed in fp32 and rounded once, except that the
normed row is rounded to the activation dtype before the norm weight multiplies it, as the
reference does.
With `kv_write` = (k_cache, v_cache, slot_mapping) the same launch also writes the layer's new K/V
to their cache slots: the k heads as rotated, and Hkv more programs copy the v heads. That saves
the K/V write's own launch per layer (36 a decode step at Qwen3-8B)."""

import torch
import triton
import triton.language as tl

from blockspec.layers.kernels.pdl import await_previous_kernel, pdl_launch


@triton.jit
def rms_norm_halves(x1, x2, w1, w2, eps, dtype, D: tl.constexpr):
    """A head's halves x1, x2 in float32 (one head [HALF], or rows of heads [R, HALF]) RMS-normed
    over its D features, rounded to `dtype` (as the reference rounds the normed head) and multiplied
    by the weight's halves w1, w2. Both q/k norm + rope kernels, this module's and the fused
    attention's, norm here and rotate with `rotate_halves`."""
    axis: tl.constexpr = len(x1.shape) - 1
    r = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis, keep_dims=True) + tl.sum(x2 * x2, axis, keep_dims=True)) / D + eps)
    return (x1 * r).to(dtype).to(tl.float32) * w1, (x2 * r).to(dtype).to(tl.float32) * w2


@triton.jit
def rotate_halves(x1, x2, c1, c2, s1, s2):
    return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2


@triton.jit
def _norm_rope(x1, x2, h, t, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr, offs, mask, stride_cos, eps, dtype,
               NUM_HEADS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HALF: tl.constexpr):  # fmt: skip
    """A head's two halves (fp32), normed with the q or k weight (HAS_WEIGHT) and rotated."""
    if HAS_WEIGHT:
        is_q = h < NUM_HEADS  # both weights are loaded (a few hundred bytes, cached), one is kept
        w1 = tl.where(is_q, tl.load(q_weight_ptr + offs, mask=mask), tl.load(k_weight_ptr + offs, mask=mask))
        w2 = tl.where(
            is_q, tl.load(q_weight_ptr + HALF + offs, mask=mask), tl.load(k_weight_ptr + HALF + offs, mask=mask)
        )
        x1, x2 = rms_norm_halves(x1, x2, w1.to(tl.float32), w2.to(tl.float32), eps, dtype, 2 * HALF)
    cos = cos_ptr + t * stride_cos
    sin = sin_ptr + t * stride_cos
    c1 = tl.load(cos + offs, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin + offs, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    return rotate_halves(x1, x2, c1, c2, s1, s2)


@triton.jit
def _store_halves(ptrs, y1, y2, mask, HALF: tl.constexpr):
    """A head's halves y1, y2 to ptrs (its first half's lanes), cast to the pointers' dtype."""
    tl.store(ptrs, y1.to(ptrs.dtype.element_ty), mask=mask)
    tl.store(ptrs + HALF, y2.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(
    qkv_ptr, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_t, stride_h, stride_cos, eps,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HAS_WEIGHT: tl.constexpr, WRITE: tl.constexpr,
    HALF: tl.constexpr,  # head_dim // 2
    BLOCK: tl.constexpr,  # HALF padded to a power of two
    PDL: tl.constexpr,
):  # fmt: skip
    await_previous_kernel(PDL)
    t = tl.program_id(0).to(tl.int64)  # t * stride_t may pass 2**31 in long prefills
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    row = qkv_ptr + t * stride_t + h * stride_h
    x1 = tl.load(row + offs, mask=mask, other=0.0)
    x2 = tl.load(row + HALF + offs, mask=mask, other=0.0)
    if WRITE:  # the cache row of this token's kv head h - NUM_HEADS (k) or h - NUM_HEADS - NUM_KV_HEADS (v)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        kv_head = (h - NUM_HEADS) % NUM_KV_HEADS
        cache_offs = (slot * NUM_KV_HEADS + kv_head) * (2 * HALF) + offs
    if h < NUM_HEADS + NUM_KV_HEADS:
        y1, y2 = _norm_rope(x1.to(tl.float32), x2.to(tl.float32), h, t, q_weight_ptr, k_weight_ptr, cos_ptr,
                            sin_ptr, offs, mask, stride_cos, eps, qkv_ptr.dtype.element_ty, NUM_HEADS, HAS_WEIGHT, HALF)  # fmt: skip
        y1, y2 = y1.to(qkv_ptr.dtype.element_ty), y2.to(qkv_ptr.dtype.element_ty)
        _store_halves(row + offs, y1, y2, mask, HALF)
        if WRITE:  # a k head also to the cache (q heads: masked off)
            _store_halves(k_cache_ptr + cache_offs, y1, y2, mask & (h >= NUM_HEADS), HALF)
    elif WRITE:  # a v head: copied to the cache
        _store_halves(v_cache_ptr + cache_offs, x1, x2, mask, HALF)


def qk_norm_rope_triton(
    qkv: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    kv_write: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """qkv [..., Hq + 2*Hkv, D] (rows of heads contiguous), cos/sin [..., D]: rotates (and norms,
    with weights) the q and k heads of qkv in place; returns qkv. With `kv_write` (k_cache,
    v_cache [slots, Hkv, D] contiguous, slot_mapping [...] one slot per token) also writes each
    token's k and v heads to its slot."""
    d = qkv.shape[-1]
    rows = qkv.reshape(-1, qkv.shape[-2], d)  # a view: the model's qkv is contiguous
    cos2, sin2 = cos.reshape(-1, d), sin.reshape(-1, d)
    assert qkv.shape[-2] == num_heads + 2 * num_kv_heads, f"{qkv.shape[-2]} heads, not {num_heads} + 2 * {num_kv_heads}"
    assert (q_weight is None) == (k_weight is None), "q and k norm weights come together"
    assert rows.data_ptr() == qkv.data_ptr() and rows.stride(2) == 1 and d % 2 == 0
    assert cos2.shape[0] == rows.shape[0] and cos2.stride() == sin2.stride() and cos2.stride(1) == 1
    k_cache, v_cache, slots = kv_write if kv_write is not None else (cos2, cos2, cos2)  # unread without a write
    if kv_write is not None:
        slots = slots.reshape(-1)
        assert k_cache.shape[1:] == v_cache.shape[1:] == (num_kv_heads, d), (k_cache.shape, qkv.shape)
        assert k_cache.is_contiguous() and v_cache.is_contiguous(), "contiguous caches expected"
        assert slots.numel() == rows.shape[0], f"{rows.shape[0]} rows for {slots.numel()} slots"
    has_weight = q_weight is not None
    if rows.shape[0]:
        heads = num_heads + (2 if kv_write is not None else 1) * num_kv_heads
        _qk_norm_rope_kernel[(rows.shape[0], heads)](
            rows, q_weight if has_weight else cos2, k_weight if has_weight else cos2, cos2, sin2,
            k_cache, v_cache, slots, rows.stride(0), rows.stride(1), cos2.stride(0), eps,
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HAS_WEIGHT=has_weight, WRITE=kv_write is not None,
            HALF=d // 2, BLOCK=triton.next_power_of_2(d // 2), **pdl_launch(qkv.device),
        )  # fmt: skip
    return qkv


@triton.jit
def _layers_kv_write_kernel(
    kv_ptr, weight_ptr, cos_ptr, sin_ptr, slot_ptrs, k_caches, v_caches, stride_l, stride_t, stride_cos, eps,
    NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Program (token t, layer, head h): layer's k head h (h < Hkv; normed with the layer's weight
    row and rotated) or v head h - Hkv, from kv (rows [2 * Hkv, D]: k heads, then v heads), to
    that layer's cache slot of t."""
    t, layer, h = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    row = kv_ptr + layer * stride_l + t * stride_t + h * (2 * HALF)
    x1 = tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(row + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    is_k = h < NUM_KV_HEADS
    if is_k:  # `_norm_rope` with no q heads: the k weight, the layer's row
        w = weight_ptr + layer * (2 * HALF)
        x1, x2 = _norm_rope(x1, x2, h, t, w, w, cos_ptr, sin_ptr, offs, mask, stride_cos, eps,
                            kv_ptr.dtype.element_ty, 0, True, HALF)  # fmt: skip
    y1, y2 = x1.to(kv_ptr.dtype.element_ty), x2.to(kv_ptr.dtype.element_ty)  # as the reference rounds them
    for i in tl.static_range(len(k_caches)):  # the caches are separate tensors: one branch a layer
        if layer == i:
            at = (tl.load(slot_ptrs[i] + t).to(tl.int64) * NUM_KV_HEADS + h % NUM_KV_HEADS) * (2 * HALF) + offs
            _store_halves(k_caches[i] + at, y1, y2, mask & is_k, HALF)
            _store_halves(v_caches[i] + at, y1, y2, mask & ~is_k, HALF)


def layers_kv_write_triton(
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    kv: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mappings: list[torch.Tensor],
) -> None:
    """kv [L, ..., 2, Hkv, D] (rows of 2 * Hkv * D contiguous elements), k_weight [L, D], cos/sin
    [..., D], slot_mappings[i] [...] layer i's slots: every layer's K and V into its caches [slots,
    Hkv, D] (contiguous)."""
    L, d, hkv = kv.shape[0], kv.shape[-1], kv.shape[-2]
    rows = kv.reshape(L, -1, 2 * hkv * d)  # a view: the GEMM's output rows
    cos2, sin2 = cos.reshape(-1, d), sin.reshape(-1, d)
    slots = tuple(s.reshape(-1) for s in slot_mappings)
    assert len(caches) == L == len(slots) and k_weight.shape == (L, d) and k_weight.is_contiguous() and d % 2 == 0
    assert all(s.stride(0) == 1 for s in slots), "slot_mapping's rows read as one contiguous run"
    assert rows.data_ptr() == kv.data_ptr() and rows.stride(2) == 1 and all(rows.shape[1] == s.numel() for s in slots)
    assert cos2.shape[0] == rows.shape[1] and cos2.stride() == sin2.stride() and cos2.stride(1) == 1
    assert all(c.is_contiguous() and c.shape[1:] == (hkv, d) for pair in caches for c in pair)
    if rows.shape[1]:
        _layers_kv_write_kernel[(rows.shape[1], L, 2 * hkv)](
            rows, k_weight, cos2, sin2, slots, tuple(k for k, _ in caches), tuple(v for _, v in caches),
            rows.stride(0), rows.stride(1), cos2.stride(0), eps, NUM_KV_HEADS=hkv, HALF=d // 2,
            BLOCK=triton.next_power_of_2(d // 2),
        )  # fmt: skip
