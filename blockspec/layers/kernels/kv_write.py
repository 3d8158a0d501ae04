"""K/V cache write in Triton: the CUDA implementation of `blockspec.layers.attention.write_kv`
(the reference: two index_copy_ calls). One launch writes both caches: program (i, 0) copies row i
of k to k_cache[slot_mapping[i]], program (i, 1) row i of v to v_cache. A decode step writes a few
rows per layer, so the two launches it saves per layer are most of the cost."""

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_write_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_k,
    stride_v,
    ROW: tl.constexpr,  # kv_heads * head_dim
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)  # i * stride passes 2**31 in long drafter context writes
    slot = tl.load(slot_ptr + i).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    if tl.program_id(1) == 0:
        row = tl.load(k_ptr + i * stride_k + offs, mask=mask)
        tl.store(k_cache_ptr + slot * ROW + offs, row.to(k_cache_ptr.dtype.element_ty), mask=mask)
    else:
        row = tl.load(v_ptr + i * stride_v + offs, mask=mask)
        tl.store(v_cache_ptr + slot * ROW + offs, row.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v [..., Hkv, D] (any leading shape, rows of Hkv*D contiguous elements) into contiguous
    caches [slots, Hkv, D] at slot_mapping [...]."""
    row = k_cache.shape[1] * k_cache.shape[2]
    k2, v2 = k.reshape(-1, row), v.reshape(-1, row)  # views for the layouts we write (head rows contiguous)
    slots = slot_mapping.reshape(-1)
    assert k.shape[-2:] == v.shape[-2:] == k_cache.shape[1:] == v_cache.shape[1:], (k.shape, k_cache.shape)
    assert k2.shape[0] == v2.shape[0] == slots.numel(), f"{k2.shape[0]} rows for {slots.numel()} slots"
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k2.stride(1) == 1 and v2.stride(1) == 1
    if slots.numel():
        _kv_write_kernel[(slots.numel(), 2)](
            k2, v2, k_cache, v_cache, slots, k2.stride(0), v2.stride(0), ROW=row, BLOCK=triton.next_power_of_2(row)
        )
