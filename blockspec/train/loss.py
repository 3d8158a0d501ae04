"""One training forward of a block drafter: anchors -> blocks -> the frozen target's pass (its
context features and its own next-token distribution) -> the drafter over all blocks at once ->
the loss of the drafter's kind.

A block is [anchor token, MASK x (g-1)] at positions anchor .. anchor+g-1, and its draft i
(i = 0, 1, ..) predicts the token at anchor+1+i, the target's own output: z-lab's DFlash rows
1..g-1 (g-1 drafts), DSpark's shifted rows 0..g-1 (g drafts). Draft i's loss weight exp(-i/gamma)
favours early drafts: a draft is only accepted up to its first miss.
- DFlash: cross-entropy on the target's tokens.
- DFlash2: DFlash's, plus selector * the candidate selector's K-way cross-entropy (undecayed, its
  own mean over the labelled drafts): each draft's top K tokens by the LM head, the gold token in
  the lowest one's place where it is not among them, scored as the engine's walk scores them
  against the token before the draft, teacher-forced (the anchor, then the target's tokens).
- DSpark (DeepSpec's recipe): the drafts' logits are the LM head's plus the Markov bias of the
  token before each draft, teacher-forced (the anchor, then the target's tokens); the loss is
  ce * CE + l1 * |p_draft - p_target|_1 + confidence * BCE(confidence logit, 1 - L1/2), p_target
  the target's distribution of the same token."""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from blockspec.layers.attention import DenseAttention, visibility
from blockspec.models.causal_lm import CausalLM
from blockspec.models.dflash import DFlashDrafter
from blockspec.models.dflash2 import DFlash2Drafter
from blockspec.models.dspark import DSparkDrafter
from blockspec.train.batches import Batch
from blockspec.train.masks import block_attention


@dataclass
class StepResult:
    # scalar or [terms], differentiable: each term's weighted loss summed over labelled drafts
    loss_sum: torch.Tensor
    # its shape: each term's summed weights (the loss is the sum of loss_sum / weight over the whole batch)
    weight: torch.Tensor
    correct: torch.Tensor  # [n] argmax hits per draft 0..n-1 of a block
    total: torch.Tensor  # [n] labelled drafts per draft index
    inverse_tau: torch.Tensor  # scalar: sum over valid blocks of 1 / (1 + leading hits)
    blocks: torch.Tensor  # scalar: valid blocks
    drafts: torch.Tensor  # [B, N, n] greedy drafts of the labelled rows (0 elsewhere)


@dataclass(frozen=True)
class DSparkWeights:
    """The weights of DSpark's three loss terms."""

    ce: float
    l1: float
    confidence: float


@dataclass
class Blocks:
    """A step's blocks through the drafter, and the target pass they read."""

    hidden: torch.Tensor  # [B, N, n, H] the drafter's normed output at its draft rows
    anchor_ids: torch.Tensor  # [B, N]
    labels: torch.Tensor  # [B, N, n] the token at anchor+1+i (clamped garbage where not labelled)
    labelled: torch.Tensor  # [B, N, n] bool: a valid block's draft whose token exists
    target_hidden: torch.Tensor  # [B, T, H_t] the target's final (normed) hidden states

    @property
    def previous(self) -> torch.Tensor:
        """[B, N, n] the token before each draft's, teacher-forced: the anchor, then the labels."""
        return torch.cat([self.anchor_ids[:, :, None], self.labels[:, :, :-1]], -1)


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


def row_weights(num_drafts: int, gamma: float, device: torch.device) -> torch.Tensor:
    """[n]: exp(-i/gamma) for a block's drafts i = 0..n-1."""
    return torch.exp(-torch.arange(num_drafts, device=device, dtype=torch.float32) / gamma)


@torch.no_grad()
def target_pass(target: CausalLM, batch: Batch, capture: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen target over every position, once: its final hidden states [B, T, H_t] (normed,
    the LM head's input) and its captured layer outputs [B, T, n*H_t]."""
    b, t = batch.input_ids.shape
    positions = torch.arange(t, device=batch.input_ids.device).expand(b, t)
    valid, window = positions < batch.lengths[:, None], target.sliding_window
    masks = {"full_attention": visibility(positions, positions, valid, causal=True, window=None)}
    if window is not None:  # a target with sliding layers
        masks["sliding_attention"] = visibility(positions, positions, valid, causal=True, window=window)
    return target(batch.input_ids, positions, DenseAttention(masks), [None] * len(target.model.layers), capture)


def draft_blocks(
    target: CausalLM, drafter: DFlashDrafter, batch: Batch, anchors: torch.Tensor, valid: torch.Tensor, flex: bool
) -> Blocks:
    (b, t), g, n = batch.input_ids.shape, drafter.block_size, drafter.num_drafts
    offsets = torch.arange(g, device=anchors.device)
    block_pos = anchors[:, :, None] + offsets  # [B, N, g]
    with torch.no_grad():
        target_hidden, features = target_pass(target, batch, drafter.target_layer_ids)
        anchor_ids = batch.input_ids.gather(1, anchors)
        block_ids = torch.full_like(block_pos, drafter.mask_token_id)
        block_ids[:, :, 0] = anchor_ids
        # one block per leading index, as the engine runs them (masks.py); the target's embedding, frozen
        embeds = drafter.embed(block_ids.flatten(0, 1), target)
        label_pos = anchors[:, :, None] + 1 + offsets[:n]
        labels = batch.input_ids.gather(1, label_pos.clamp(max=t - 1).flatten(1)).view(b, -1, n)
        # a prefix of each block's drafts, as DeepSpec's cumprod makes it: labels end only where the sequence does
        labelled = valid[:, :, None] & (label_pos < batch.lengths[:, None, None])

    drafter.fuse_kv()  # under autograd: gradients reach every layer's k/v projections and k_norm
    positions = torch.arange(t, device=anchors.device).expand(b, t)
    k, v = drafter.context_kv(features, positions)
    attn = block_attention(anchors, valid, t, g, flex)
    hidden = drafter(embeds, block_pos.flatten(0, 1), attn, list(zip(k, v)))
    first = drafter.first_draft_row
    hidden = hidden.view(b, -1, g, hidden.shape[-1])[:, :, first : first + n]
    return Blocks(hidden, anchor_ids, labels, labelled, target_hidden)


def by_row_chunks(
    fn: Callable[..., tuple[torch.Tensor, ...]], elements: int, vocab: int, *rows: torch.Tensor | None
) -> tuple:
    """fn's per-row outputs over the rows [M, ...] of `rows` (None passed through), concatenated.
    Where the rows' vocabulary-wide tensors exceed `elements` (0: never), fn runs on chunks of
    rows, each checkpointed when gradients are on: the backward pass recomputes one chunk at a
    time, so one chunk's tensors are alive, not every row's (and the loss is the same sum)."""
    m = next(r for r in rows if r is not None).shape[0]
    size = max(1, elements // vocab) if elements else m
    if m <= size:
        return fn(*rows)
    chunks = []
    for start in range(0, m, size):
        part = [None if r is None else r[start : start + size] for r in rows]
        chunks.append(checkpoint(fn, *part, use_reentrant=False) if torch.is_grad_enabled() else fn(*part))
    return tuple(torch.cat(outs) for outs in zip(*chunks))


def step_result(
    blocks: Blocks, valid: torch.Tensor, loss_sum: torch.Tensor, weight: torch.Tensor, greedy: torch.Tensor
) -> StepResult:
    """The result of a step's loss terms and the labelled drafts' greedy tokens [M]."""
    with torch.no_grad():
        labels, labelled = blocks.labels, blocks.labelled
        drafts = torch.zeros_like(labels)
        drafts[labelled] = greedy
        hits = (drafts == labels) & labelled
        tau = 1 + hits.int().cumprod(-1).sum(-1)[valid]  # greedy acceptance length per block
    return StepResult(loss_sum, weight, hits.sum((0, 1)), labelled.sum((0, 1)), (1 / tau).sum(), valid.sum(), drafts)


def dflash_loss(
    target: CausalLM,
    drafter: DFlashDrafter,
    batch: Batch,
    anchors: torch.Tensor,
    valid: torch.Tensor,
    weights: torch.Tensor,
    flex: bool = False,
    chunk_elements: int = 0,
) -> StepResult:
    blocks = draft_blocks(target, drafter, batch, anchors, valid, flex)
    labelled = blocks.labelled

    def rows(hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = drafter.compute_logits(hidden, target)  # the target's LM head, frozen
        return F.cross_entropy(logits.float(), labels, reduction="none"), logits.argmax(-1)

    vocab, hidden, labels = target.config.vocab_size, blocks.hidden[labelled], blocks.labels[labelled]
    ce, greedy = by_row_chunks(rows, chunk_elements, vocab, hidden, labels)
    w = weights.expand_as(labelled)[labelled]
    return step_result(blocks, valid, (ce * w).sum(), w.sum(), greedy)


def candidates_with_gold(top: torch.Tensor, gold: torch.Tensor) -> torch.Tensor:
    """Each row's top token ids [M, k], the gold token [M] in the lowest one's place where it is
    not among them: the recipe's candidates."""
    missing = (top != gold[:, None]).all(-1)
    return torch.cat([top[:, :-1], torch.where(missing, gold, top[:, -1])[:, None]], -1)


def dflash2_loss(
    target: CausalLM,
    drafter: DFlash2Drafter,
    batch: Batch,
    anchors: torch.Tensor,
    valid: torch.Tensor,
    weights: torch.Tensor,
    selector_weight: float,
    flex: bool = False,
    chunk_elements: int = 0,
) -> StepResult:
    """DFlash2's loss: two terms, each its own mean over the batch. Its greedy drafts (accuracy,
    tau) are the selector's teacher-forced best among each draft's top K (the serving candidates,
    no gold put in): the engine's walk wherever the drafts before all hit."""
    blocks = draft_blocks(target, drafter, batch, anchors, valid, flex)
    labels, labelled, selector = blocks.labels, blocks.labelled, drafter.candidate_selector
    hidden, gold = blocks.hidden[labelled], labels[labelled]

    def rows(hidden: torch.Tensor, gold: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The vocabulary-wide part: each row's CE, its top K (the serving candidates, with their
        logits) and the recipe's candidates (with theirs)."""
        logits = drafter.compute_logits(hidden, target).float()  # the target's LM head, frozen
        unary, top = logits.topk(selector.top_k, -1)
        ids = candidates_with_gold(top, gold)
        ce = F.cross_entropy(logits, gold, reduction="none")
        return ce, logits.gather(-1, ids), ids, unary.detach(), top

    vocab = target.config.vocab_size
    ce, candidate_logits, ids, unary, top = by_row_chunks(rows, chunk_elements, vocab, hidden, gold)
    w = weights.expand_as(labelled)[labelled]
    prev = blocks.previous[labelled]
    # each candidate scored after the one predecessor teacher forcing gives its row
    scores = selector.scores(candidate_logits, ids, hidden, prev[:, None])[:, 0]
    selector_ce = F.cross_entropy(scores, (ids == gold[:, None]).int().argmax(-1), reduction="sum")
    with torch.no_grad():
        scores = selector.scores(unary, top, hidden, prev[:, None])[:, 0]
        greedy = top.gather(-1, scores.argmax(-1, keepdim=True))[:, 0]
    loss_sum = torch.stack([(ce * w).sum(), selector_weight * selector_ce])
    return step_result(blocks, valid, loss_sum, torch.stack([w.sum(), w.new_tensor(len(gold))]), greedy)


def dspark_loss(
    target: CausalLM,
    drafter: DSparkDrafter,
    batch: Batch,
    anchors: torch.Tensor,
    valid: torch.Tensor,
    weights: torch.Tensor,
    terms: DSparkWeights,
    flex: bool = False,
    chunk_elements: int = 0,
) -> StepResult:
    """DSpark's loss. Its greedy drafts (accuracy, tau) are teacher-forced argmaxes: a draft's
    Markov bias reads the target's token before it, which is the engine's own draft wherever
    the drafts before it all hit, so the leading hits (tau) are the engine's."""
    blocks = draft_blocks(target, drafter, batch, anchors, valid, flex)
    hidden, labels, labelled = blocks.hidden, blocks.labels, blocks.labelled
    head, prev_embeddings, latents = drafter.markov_head, None, None
    if head is not None:
        latents, prev_embeddings = head.latents(blocks.previous, hidden)
        latents = latents[labelled]
    t = blocks.target_hidden.shape[1]
    # the target's hidden state whose distribution is draft i's token's: position anchor+i
    at = (anchors[:, :, None] + torch.arange(labels.shape[-1], device=anchors.device)).clamp(max=t - 1)
    target_rows = blocks.target_hidden[torch.arange(len(at), device=at.device)[:, None, None], at][labelled]

    def rows(
        hidden: torch.Tensor, latents: torch.Tensor | None, target_rows: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = drafter.draft_logits(hidden, target).float()
        if latents is not None:
            logits = logits + head.bias(latents).float()
        logits = drafter.to_target(logits, target)
        with torch.no_grad():
            p_target = torch.softmax(target.compute_logits(target_rows).float(), -1)
        ce = F.cross_entropy(logits, labels, reduction="none")
        l1 = (torch.softmax(logits, -1) - p_target).abs().sum(-1)
        return terms.ce * ce + terms.l1 * l1, l1, logits.argmax(-1)

    loss, l1, greedy = by_row_chunks(
        rows, chunk_elements, target.config.vocab_size, hidden[labelled], latents, target_rows, labels[labelled]
    )
    confidence = drafter.confidence_logits(hidden, prev_embeddings)
    if confidence is not None:  # the chance of acceptance, sum of min(p, q): 1 - L1/2
        accept = (1 - l1.detach() / 2).clamp(0, 1)
        bce = F.binary_cross_entropy_with_logits(confidence[labelled], accept, reduction="none")
        loss = loss + terms.confidence * bce
    w = weights.expand_as(labelled)[labelled]
    return step_result(blocks, valid, (loss * w).sum(), w.sum(), greedy)


class Objective(nn.Module):
    """A step's loss as a module whose parameters are the drafter's, for DDP to wrap: the whole
    differentiable computation (context K/V, LM head, heads) runs in its forward, and the frozen
    target comes with each call, so it is never broadcast nor reduced."""

    def __init__(self, drafter: DFlashDrafter, loss: Callable[..., StepResult]) -> None:
        super().__init__()
        self.drafter, self.loss = drafter, loss

    def forward(self, target: CausalLM, batch: Batch, anchors: torch.Tensor, valid: torch.Tensor) -> StepResult:
        return self.loss(target, self.drafter, batch, anchors, valid)
