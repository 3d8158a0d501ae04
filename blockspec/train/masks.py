"""The DFlash training mask, over keys [context 0..T-1 ; block 0 ; block 1 ; ...] (g rows per
block) for queries [block 0 ; block 1 ; ...]:
- a block row sees the context strictly before its anchor: at inference the anchor is the
  newest token, not yet processed by the target, so its own feature does not exist yet;
- inside a block, every row sees every row (bidirectional);
- blocks never see each other, so one forward trains many independent blocks.
A padded (invalid) block sees only its own rows, so no softmax row is empty.

Two forms, both used through the drafter's `attn.attend(...)` call: a dense bool mask for
`DenseAttention` (any device), and a FlexAttention `BlockMask` (CUDA), which skips the
invisible tiles. The drafter runs the blocks as [B*N, g] rows, one block per leading index as
the engine runs it (DFlash2's block convolutions read the rows before along that axis: across
blocks, were they laid end to end); `BlockRows` attends them as [B, N*g] rows of their sequence."""

from dataclasses import dataclass

import torch

from blockspec.layers.attention import DenseAttention, rope_then_attend


def block_mask(anchors: torch.Tensor, valid: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """[B, 1, N*g, T + N*g] bool, True = visible. anchors, valid: [B, N]."""
    n = anchors.shape[1]
    q_block = torch.arange(n * block_size, device=anchors.device) // block_size
    limit = torch.where(valid, anchors, 0)[:, q_block]  # [B, Q]: context keys below this are seen
    sees_context = torch.arange(context_len, device=anchors.device) < limit[:, :, None]
    sees_block = (q_block[:, None] == q_block[None, :]).expand(len(anchors), -1, -1)
    return torch.cat([sees_context, sees_block], dim=-1)[:, None]


def flex_block_mask(anchors: torch.Tensor, valid: torch.Tensor, context_len: int, block_size: int):
    """The same visibility as `block_mask`, as a FlexAttention BlockMask."""
    from torch.nn.attention.flex_attention import create_block_mask

    limit = torch.where(valid, anchors, 0)

    def visible(b, h, q, kv):
        block = q // block_size
        return torch.where(kv < context_len, kv < limit[b, block], (kv - context_len) // block_size == block)

    b, n = anchors.shape
    q_len = n * block_size
    return create_block_mask(visible, b, None, q_len, context_len + q_len, device=anchors.device)


_flex_attention = None


def compiled_flex_attention():
    global _flex_attention
    if _flex_attention is None:  # compiled once: uncompiled flex_attention materializes the scores
        from torch.nn.attention.flex_attention import flex_attention

        _flex_attention = torch.compile(flex_attention, dynamic=False)
    return _flex_attention


@dataclass
class FlexBlockAttention:
    """DenseAttention's contract (context K/V [B, T, Hkv, D] before the block's own) with a BlockMask."""

    block_mask: object  # torch.nn.attention.flex_attention.BlockMask

    kv_write = DenseAttention.kv_write
    attend_qkv = rope_then_attend

    def attend(self, q, k, v, cache, layer_type: str, scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
        assert sinks is None, "drafter layers have no attention sinks"
        k, v = torch.cat([cache[0], k], dim=1), torch.cat([cache[1], v], dim=1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = compiled_flex_attention()(q, k, v, block_mask=self.block_mask, scale=scale, enable_gqa=True)
        return out.transpose(1, 2)


@dataclass
class BlockRows:
    """`inner`'s attention (context K/V [B, T, Hkv, D], queries [B, N*g]) for queries, keys and
    values laid out [B*N, g, heads, D]."""

    inner: DenseAttention | FlexBlockAttention
    blocks: int  # N, per sequence

    kv_write = DenseAttention.kv_write
    attend_qkv = rope_then_attend

    def attend(self, q, k, v, cache, layer_type: str, scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
        rows = q.shape[:2]
        q, k, v = (t.reshape(-1, self.blocks * rows[1], *t.shape[2:]) for t in (q, k, v))
        out = self.inner.attend(q, k, v, cache, layer_type, scale, sinks)
        return out.reshape(*rows, *out.shape[2:])


def block_attention(
    anchors: torch.Tensor, valid: torch.Tensor, context_len: int, block_size: int, flex: bool
) -> BlockRows:
    n = anchors.shape[1]
    if flex:
        return BlockRows(FlexBlockAttention(flex_block_mask(anchors, valid, context_len, block_size)), n)
    return BlockRows(DenseAttention({"full_attention": block_mask(anchors, valid, context_len, block_size)}), n)
