"""The DFlash2 drafter (`DFlash2DraftModel`): DFlash with two additions.

- Block convolutions: each sublayer (attention, MLP) is wrapped on its input side and on its
  output side by a grouped dynamic causal convolution over the block's rows (never the context,
  never across blocks): out[i, c] = sum_t (base[t, c] + delta[i, t, c // group]) * x[i - t, c],
  x[i - t] = 0 before the block's first row, both sides' deltas projected from the sublayer's
  normed input. With base = [1, 0, ...] and no projection it is the identity: DFlash.
- Candidate selector: the K best tokens of each draft row by the LM head, and a score for each
  pair (candidate p of the row before, candidate c of this row): unary[c] + sum_r
  predecessor[p, r] * proj(h)[r] * successor[c, r], the anchor the predecessor of the first row.
  A walk from the anchor picks one candidate a row (`proposers.dflash2`)."""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from blockspec.layers.attention import AttentionMetadata
from blockspec.layers.decoder import DecoderLayer, KVCache, LayerKind, LayerSpec, Rope
from blockspec.layers.linear import Linear
from blockspec.models.dflash import (
    DFlashDrafter,
    dflash_problems,
    dflash_value,
    draft_vocab_size,
    fc_problems,
    rows_shifted,
)
from blockspec.models.registry import DrafterKind
from blockspec.sampling import is_int

ARCHITECTURE = "DFlash2DraftModel"


def block_conv(x: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
    """out[..., i, c] = sum_t kernel[..., i, t, c] * x[..., i - t, c] over rows i of a block (x [..., S,
    H], one block per leading index; kernel [..., S, taps, H]), rows before the first zero."""
    out = kernel[..., 0, :] * x
    for t in range(1, kernel.shape[-2]):
        out = out + F.pad(kernel[..., t:, t, :] * x[..., :-t, :], (0, 0, t, 0))
    return out


class BlockConv(nn.Module):
    """The convolutions around one sublayer: `base_kernel` [side, tap, channel] (side 0: input,
    1: output) plus deltas that `kernel_projection` makes per row and channel group, its output
    laid out [side, tap, group]."""

    def __init__(self, hidden_size: int, taps: int, group_size: int) -> None:
        super().__init__()
        self.taps, self.group_size = taps, group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden_size))
        self.kernel_projection = Linear(hidden_size, 2 * taps * (hidden_size // group_size), bias=False)
        with torch.no_grad():  # the identity, as training starts from
            self.base_kernel[:, 0] = 1
            self.kernel_projection.weight.zero_()

    def kernels(self, normed: torch.Tensor) -> torch.Tensor:
        """Both sides' kernels [..., S, 2, taps, H] from the sublayer's normed input [..., S, H]."""
        delta = self.kernel_projection(normed).view(*normed.shape[:-1], 2, self.taps, -1)
        return self.base_kernel + delta.repeat_interleave(self.group_size, -1)


class DFlash2Layer(DecoderLayer):
    """A decoder layer whose attention and MLP each read the input-side convolution of their normed
    input and add the output-side convolution of their output to the residual stream."""

    def __init__(self, s: LayerSpec, kind: LayerKind, taps: int, group_size: int) -> None:
        super().__init__(s, kind)
        self.attention_conv = BlockConv(s.hidden_size, taps, group_size)
        self.mlp_conv = BlockConv(s.hidden_size, taps, group_size)

    def forward(self, x: torch.Tensor, rope: Rope, cache: KVCache, attn: AttentionMetadata) -> torch.Tensor:
        u = self.input_layernorm(x)
        k = self.attention_conv.kernels(u)
        a = self.self_attn(block_conv(u, k[..., 0, :, :]), None, rope, cache, attn, residual=False)
        x = x + block_conv(a, k[..., 1, :, :])
        v = self.post_attention_layernorm(x)
        k = self.mlp_conv.kernels(v)
        m = self.mlp(block_conv(v, k[..., 0, :, :]), None, residual=False)
        return x + block_conv(m, k[..., 1, :, :])


class CandidateSelector(nn.Module):
    def __init__(self, vocab_size: int, rank: int, hidden_size: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        # as training starts: a zero successor codebook keeps the LM head's ranking
        self.predecessor_codebook = nn.Parameter(torch.randn(vocab_size, rank) * 0.02)
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.hidden_projection = Linear(hidden_size, rank, bias=False)

    def lattice(
        self, logits: torch.Tensor, hidden: torch.Tensor, anchors: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each draft row's candidates [B, n, K] (the top K of its logits [B, n, V]) and the scores
        [B, n, K, K] of (candidate p of the row before, candidate c of this row); the first row's
        predecessor is the anchor [B] in every slot. hidden: the rows' [B, n, H]."""
        unary, ids = logits.topk(self.top_k, dim=-1)  # in the logits' dtype: no fp32 copy of the vocabulary
        prev = torch.cat([anchors[:, None, None].expand(-1, 1, self.top_k), ids[:, :-1]], 1)
        return ids, self.scores(unary, ids, hidden, prev)

    def scores(self, unary: torch.Tensor, ids: torch.Tensor, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """[..., P, K]: candidates ids [..., K] of LM-head logits unary [..., K], each after each
        predecessor token prev [..., P]: unary + sum_r predecessor[prev, r] * proj(hidden)[r] *
        successor[id, r], in fp32. hidden: the row's [..., H]."""
        gate = self.hidden_projection(hidden).float()[..., None, :]  # [..., 1, r]
        pred = F.embedding(prev, self.predecessor_codebook).float() * gate
        succ = F.embedding(ids, self.successor_codebook).float()
        return unary.float()[..., None, :] + pred @ succ.transpose(-1, -2)


class DFlash2Drafter(DFlashDrafter):
    proposer = "dflash2"

    def build_heads(self, config: PretrainedConfig) -> None:
        """The candidate selector."""
        rank, top_k = int(dflash_value(config, "selector_rank", 0)), int(dflash_value(config, "selector_top_k", 0))
        h = self.spec.hidden_size
        self.candidate_selector = CandidateSelector(config.vocab_size, rank, h, top_k) if rank else None

    def decoder_layer(self, kind: LayerKind) -> nn.Module:
        taps = int(dflash_value(self.config, "conv_kernel_size", 0))
        if not taps:
            return super().decoder_layer(kind)
        return DFlash2Layer(self.spec, kind, taps, int(dflash_value(self.config, "conv_group_size")))

    def checkpoint_fields(self) -> dict:
        """z-lab's layout with the convolution and selector fields."""
        fields = super().checkpoint_fields()
        layer, selector = self.layers[0], self.candidate_selector
        conv = layer.attention_conv if isinstance(layer, DFlash2Layer) else None
        fields["dflash_config"] |= {
            "conv_kernel_size": conv.taps if conv is not None else 0,
            "conv_group_size": conv.group_size if conv is not None else 0,
            "selector_rank": selector.predecessor_codebook.shape[1] if selector is not None else 0,
            "selector_top_k": selector.top_k if selector is not None else 0,
        }
        return {**fields, "architectures": [ARCHITECTURE]}


def dflash2_problems(config: PretrainedConfig, target: PretrainedConfig) -> list[str]:
    """DFlash's problems, and the convolution's and selector's fields: each pair set together,
    the taps within the block, the channel groups dividing the width, the candidates within the
    vocabulary, which is the target's (the codebooks are indexed by target ids)."""
    problems = dflash_problems(config, target)
    for a, b in (("conv_kernel_size", "conv_group_size"), ("selector_rank", "selector_top_k")):
        va, vb = dflash_value(config, a, 0), dflash_value(config, b, 0)
        if not (is_int(va) and is_int(vb) and va >= 0 and vb >= 0):
            problems.append(f"{a} and {b} must be integers >= 0, got {va!r} and {vb!r}")
        elif bool(va) != bool(vb):
            problems.append(f"{a} and {b} are set together (both 0: none), got {va} and {vb}")
    taps, group = dflash_value(config, "conv_kernel_size", 0), dflash_value(config, "conv_group_size", 0)
    block, top_k = dflash_value(config, "block_size"), dflash_value(config, "selector_top_k", 0)
    if is_int(taps) and is_int(block) and taps > block:
        problems.append(f"conv_kernel_size {taps} is wider than the block ({block} rows)")
    if is_int(group) and group > 0 and config.hidden_size % group:
        problems.append(f"conv_group_size {group} does not divide hidden_size {config.hidden_size}")
    if is_int(top_k) and top_k > target.vocab_size:
        problems.append(f"selector_top_k {top_k} is more than the vocabulary ({target.vocab_size})")
    if draft_vocab_size(config) < config.vocab_size:
        problems.append("DFlash2 drafts over the target's whole vocabulary (its codebooks are indexed by target ids)")
    if rows_shifted(config, False):
        problems.append("DFlash2's rows fill in the block: sample_from_anchor (shift_label) must not be true")
    return problems


DRAFTER = DrafterKind(
    "dflash2",
    architectures=(ARCHITECTURE,),
    model=DFlash2Drafter,
    problems=dflash2_problems,
    weight_problems=fc_problems,
)
