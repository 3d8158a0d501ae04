"""Attention over a paged KV cache.

A cache is `[num_slots, kv_heads, head_dim]` per layer for K and for V, where slot =
page * page_size + offset; a sequence's pages are listed in its row of its layer's cache group's
`block_tables` (a group of sliding layers releases the pages before their window: trash there).
Every forward first writes its new K/V to their slots (`kv_write`: with the rotary embedding,
`blockspec.layers.kv_write` lists where), then each query row attends to the keys of its
sequence at positions k_start <= k < k_end:
- target prefill/verify (causal): [0, pos + 1);
- drafter propose: [p - window, p + width): the cached context plus the whole block, so the
  block is bidirectional (a drafter's sliding-window layers are causal inside the block, as in
  the DFlash reference implementation). The block's K/V land in slots past the committed context, where
  the next commit overwrites them: they never become context.
`paged_attention_ref` is the plain-PyTorch reference (CPU, and the oracle for the Triton
kernel that serves CUDA behind `paged_attention`). A layer calls `attend_qkv` with its fused
q|k|v projection: the q/k norm + rope with the K/V write, then the attention (`rope_then_attend`);
on CUDA a step whose rows fit one query tile (decode, verify, propose) does all of it in one
launch (`qkv_attention_triton`).
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from blockspec.layers.fast_path import fast_kernels
from blockspec.layers.kv_write import KVWrite
from blockspec.layers.recurrent_state import RecurrentStates
from blockspec.layers.rotary import qk_norm_rope
from blockspec.layers.row_invariant import KeyPlan, gather_pages, row_invariant, tiled_attention

KeyRange = tuple[torch.Tensor, torch.Tensor]  # (k_start, k_end), each [B, S]


@dataclass
class AttentionMetadata:
    block_tables: torch.Tensor  # [B, G, M] page ids per cache group, padded with the trash page 0
    slot_mapping: torch.Tensor  # [G, B, S] slots of the new K/V per group (padding rows: trash slot 0)
    groups: dict[str, int]  # layer type -> its cache group (`engine.kv_cache_manager.CacheLayout`)
    key_ranges: dict[str, KeyRange]  # layer type -> visible key positions per query row
    page_size: int
    starts: torch.Tensor  # [B] position of each sequence's first row (the rest follow it)
    states: RecurrentStates | None = None  # the linear-attention layers' state slots (targets only)
    # layer type -> row-invariant attention's plans of its keys (`tiled_attention`), made by its first layer
    key_plans: dict[str, dict[tuple[int, int], KeyPlan]] = field(default_factory=dict)

    def tables(self, layer_type: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer type's block tables [B, M] and new K/V slots [B, S]."""
        group = self.groups[layer_type]
        return self.block_tables[:, group], self.slot_mapping[group]

    def attend_qkv(
        self,
        qkv: torch.Tensor,
        norms: tuple[torch.Tensor | None, torch.Tensor | None],
        eps: float,
        rope: tuple[torch.Tensor, torch.Tensor],
        heads: tuple[int, int],
        cache: tuple[torch.Tensor, torch.Tensor],
        layer_type: str,
        scale: float,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`rope_then_attend`; on CUDA, for a step of one query tile, in one launch
        (`qkv_attention_triton`: its q and k normed and rotated in registers)."""
        kernels = None if row_invariant() else fast_kernels(qkv, "paged_attention")
        partial_rotary = rope[0].shape[-1] != qkv.shape[-1]  # the fused kernel rotates whole heads
        if kernels is None or partial_rotary or not kernels.fuses_qkv(qkv, cache[0]):
            return rope_then_attend(self, qkv, norms, eps, rope, heads, cache, layer_type, scale, sinks)
        k_start, k_end = self.key_ranges[layer_type]
        block_tables, slot_mapping = self.tables(layer_type)
        return kernels.qkv_attention_triton(
            qkv, *norms, eps, *rope, self.starts, slot_mapping, *cache, block_tables, k_start, k_end,
            self.page_size, scale, sinks=sinks,
        )  # fmt: skip

    def kv_write(self, cache: tuple[torch.Tensor, torch.Tensor], layer_type: str) -> KVWrite:
        """Where a layer's new K/V go: its caches and this step's slots (`qk_norm_rope` writes them)."""
        return (*cache, self.tables(layer_type)[1])

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor],
        layer_type: str,
        scale: float,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [B, S, Hq, D], the new K/V already in the cache (`kv_write`); returns [B, S, Hq, D]."""
        k_start, k_end = self.key_ranges[layer_type]
        block_tables = self.tables(layer_type)[0]
        plans = self.key_plans.setdefault(layer_type, {})
        return paged_attention(q, *cache, block_tables, k_start, k_end, self.page_size, scale, sinks, plans)


def rope_then_attend(
    attn,
    qkv: torch.Tensor,
    norms: tuple[torch.Tensor | None, torch.Tensor | None],
    eps: float,
    rope: tuple[torch.Tensor, torch.Tensor],
    heads: tuple[int, int],
    cache,
    layer_type: str,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """qkv [B, S, Hq + 2 Hkv, D]: the q and k heads normed and rotated in place, the new K/V written
    to the cache (`attn.kv_write`), then q attends (`attn.attend`) -> [B, S, Hq, D]."""
    qkv = qk_norm_rope(qkv, *norms, eps, *rope, *heads, kv_write=attn.kv_write(cache, layer_type))
    q, k, v = qkv.split([heads[0], heads[1], heads[1]], dim=-2)
    return attn.attend(q, k, v, cache, layer_type, scale, sinks)


def paged_attention(
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
    """`paged_attention_ref`; on CUDA the Triton kernel; under row invariance otherwise
    `tiled_attention` (`plans`: its plans of these keys, kept across a step's layers)."""
    kernels = fast_kernels(q, "paged_attention")
    if kernels is not None:
        return kernels.paged_attention_triton(
            q, k_cache, v_cache, block_tables, k_start, k_end, page_size, scale, sinks=sinks, invariant=row_invariant()
        )
    if row_invariant():
        return tiled_attention(q, k_cache, v_cache, block_tables, k_start, k_end, page_size, scale, sinks, plans)
    return paged_attention_ref(q, k_cache, v_cache, block_tables, k_start, k_end, page_size, scale, sinks)


def paged_attention_ref(
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
    k, v = gather_pages(k_cache, block_tables, page_size), gather_pages(v_cache, block_tables, page_size)
    k_pos = torch.arange(k.shape[1], device=q.device)
    mask = (k_pos >= k_start[..., None]) & (k_pos < k_end[..., None])
    return sdpa(q, k, v, mask[:, None], scale, sinks)


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [B, S, Hq, D]; k, v: [B, L, Hkv, D]; mask: [B, 1, S, L]; returns [B, S, Hq, D]. `sinks` [Hq]
    (gpt-oss): a logit per head that joins every row's softmax with no value, so the row's weights
    sum to less than one."""
    if sinks is not None:
        return sdpa_with_sinks(q, k, v, mask, scale, sinks)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.transpose(1, 2)


def sdpa_with_sinks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, sinks: torch.Tensor
) -> torch.Tensor:
    """`sdpa` with the sink logits as one more column of each head's scores (value zero)."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q.float() @ k.float().transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return (probs.to(v.dtype) @ v).transpose(1, 2)


def visibility(
    q_pos: torch.Tensor, k_pos: torch.Tensor, k_valid: torch.Tensor, causal: bool, window: int | None
) -> torch.Tensor:
    """[B, 1, S, L] mask: key j is visible to query i when it is valid and, for causal
    attention, not after i; with a window, only the last `window` positions are seen."""
    qp, kp = q_pos[:, :, None], k_pos[:, None, :]
    mask = k_valid[:, None, :].expand(-1, q_pos.shape[1], -1)
    if causal:
        mask = mask & (kp <= qp)
    if window is not None:
        mask = mask & (qp - kp < window)
    return mask[:, None]


@dataclass
class DenseAttention:
    """Attention without a paged cache (training, reference checks): the keys are the new
    K/V, preceded by dense context K/V when a layer's `cache` is a (k, v) pair [B, T, Hkv, D]."""

    masks: dict[str, torch.Tensor]  # layer type -> [B, 1, S, T+S] (or [B, 1, S, S] without context)
    states = None  # linear-attention layers start from the zero state and write none

    def kv_write(self, cache: tuple[torch.Tensor, torch.Tensor] | None, layer_type: str) -> None:
        """None: the new K/V are read where they are, never written to a cache."""

    attend_qkv = rope_then_attend

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor] | None,
        layer_type: str,
        scale: float,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if cache is not None:
            k, v = torch.cat([cache[0], k], dim=1), torch.cat([cache[1], v], dim=1)
        return sdpa(q, k, v, self.masks[layer_type], scale, sinks)
