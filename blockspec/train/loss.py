"""One DFlash training forward: anchors -> blocks -> the frozen target's context features ->
the drafter over all blocks at once -> position-weighted cross-entropy on the target's tokens.

A block is [anchor token, MASK x (g-1)] at positions anchor .. anchor+g-1 and row k (1..g-1)
predicts the token at anchor+k, the target's own output. Its loss weight exp(-(k-1)/gamma)
favours early rows: a draft is only accepted up to its first miss."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from blockspec.layers.attention import DenseAttention, visibility
from blockspec.models.causal_lm import CausalLM
from blockspec.models.dflash import DFlashDrafter
from blockspec.train.batches import Batch
from blockspec.train.masks import block_attention


@dataclass
class StepResult:
    loss_sum: torch.Tensor  # scalar, differentiable: the weighted cross-entropy summed over labelled rows
    weight: torch.Tensor  # scalar: the summed weights (the loss is loss_sum / weight over the whole batch)
    correct: torch.Tensor  # [g-1] argmax hits per block row 1..g-1
    total: torch.Tensor  # [g-1] labelled rows per block row
    inverse_tau: torch.Tensor  # scalar: sum over valid blocks of 1 / (1 + leading hits)
    blocks: torch.Tensor  # scalar: valid blocks
    drafts: torch.Tensor  # [B, N, g-1] greedy drafts of the labelled rows (0 elsewhere)


def sample_anchors(batch: Batch, num_blocks: int, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to num_blocks distinct anchors per sequence, uniformly among positions P-1 .. L-2
    (P prompt tokens, L tokens): at inference the first anchor is the last prompt token, and
    every anchor needs at least one label after it. `keys` [B, T] are uniform random numbers
    (the anchors are the positions of the smallest allowed). Returns anchors [B, N] and valid [B, N]."""
    t = batch.input_ids.shape[1]
    pos = torch.arange(t, device=batch.lengths.device)
    ok = (pos >= batch.prompt_lengths[:, None] - 1) & (pos <= batch.lengths[:, None] - 2)
    keys = keys.to(ok.device).masked_fill(~ok, 2.0)
    keys, anchors = keys.topk(min(num_blocks, t), dim=1, largest=False)
    valid = keys < 2.0
    return torch.where(valid, anchors, 0), valid


def row_weights(block_size: int, gamma: float, device: torch.device) -> torch.Tensor:
    """[g-1]: exp(-(k-1)/gamma) for rows k = 1..g-1."""
    return torch.exp(-torch.arange(block_size - 1, device=device, dtype=torch.float32) / gamma)


@torch.no_grad()
def context_features(target: CausalLM, batch: Batch, capture: tuple[int, ...]) -> torch.Tensor:
    """The frozen target's captured layer outputs for every position: [B, T, n*H_t]."""
    b, t = batch.input_ids.shape
    positions = torch.arange(t, device=batch.input_ids.device).expand(b, t)
    valid, window = positions < batch.lengths[:, None], target.sliding_window
    masks = {"full_attention": visibility(positions, positions, valid, causal=True, window=None)}
    if window is not None:  # a target with sliding layers
        masks["sliding_attention"] = visibility(positions, positions, valid, causal=True, window=window)
    attn = DenseAttention(masks)
    _, features = target(batch.input_ids, positions, attn, [None] * len(target.model.layers), capture)
    return features


def dflash_loss(
    target: CausalLM,
    drafter: DFlashDrafter,
    batch: Batch,
    anchors: torch.Tensor,
    valid: torch.Tensor,
    weights: torch.Tensor,
    flex: bool = False,
) -> StepResult:
    (b, t), g = batch.input_ids.shape, drafter.block_size
    offsets = torch.arange(g, device=anchors.device)
    block_pos = anchors[:, :, None] + offsets  # [B, N, g]
    with torch.no_grad():
        features = context_features(target, batch, drafter.target_layer_ids)
        block_ids = torch.full_like(block_pos, drafter.mask_token_id)
        block_ids[:, :, 0] = batch.input_ids.gather(1, anchors)
        embeds = target.embed(block_ids.flatten(1))  # the target's embedding, frozen
        labels = batch.input_ids.gather(1, block_pos[:, :, 1:].clamp(max=t - 1).flatten(1)).view(b, -1, g - 1)
        labelled = valid[:, :, None] & (block_pos[:, :, 1:] < batch.lengths[:, None, None])  # [B, N, g-1]

    drafter.fuse_kv()  # under autograd: gradients reach every layer's k/v projections and k_norm
    positions = torch.arange(t, device=anchors.device).expand(b, t)
    k, v = drafter.context_kv(features, positions)
    attn = block_attention(anchors, valid, t, g, flex)
    hidden = drafter(embeds, block_pos.flatten(1), attn, list(zip(k, v)))
    hidden = hidden.view(b, -1, g, hidden.shape[-1])[:, :, 1:][labelled]  # only rows with a label
    logits = drafter.compute_logits(hidden, target)  # the target's LM head, frozen
    ce = F.cross_entropy(logits.float(), labels[labelled], reduction="none")
    w = weights.expand_as(labelled)[labelled]

    with torch.no_grad():
        drafts = torch.zeros_like(labels)
        drafts[labelled] = logits.argmax(-1)
        hits = (drafts == labels) & labelled
        tau = 1 + hits.int().cumprod(-1).sum(-1)[valid]  # greedy acceptance length per block
    return StepResult(
        (ce * w).sum(), w.sum(), hits.sum((0, 1)), labelled.sum((0, 1)), (1 / tau).sum(), valid.sum(), drafts
    )
