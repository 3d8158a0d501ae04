"""The DFlash drafter: Qwen3 decoder layers whose attention sees the target's context through K/V
injection, and a block of [anchor, MASK, ...] rows attending bidirectionally. Its config and
tensors in any published dialect (`blockspec.models.dialects`) read as z-lab's `DFlashDraftModel`.

Rows: z-lab's drafters fill in the block, row j drafting position s+j (rows 1..B-1: B-1 drafts);
shifted drafters (`sample_from_anchor`: DeepSpec's) draft the next token, row j position s+j+1
(rows 0..B-1: B drafts). Vocabulary: the target's embedding and LM head, or the copies a
checkpoint ships; a reduced draft vocabulary (`draft_vocab_size`) has its own head, whose ids map
to the target's through `draft_to_target` (the checkpoint's `d2t` offsets added to them).

Context K/V: for each committed position t, c[t] = hidden_norm(fc(feat[t])) and every layer's
K = rope(k_norm(k_proj(c))), V = v_proj(c). All layers read the same c, so their k/v
projections are stacked into one weight and computed with one GEMM (`fused_kv`)."""

from collections.abc import Collection

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from blockspec.layers.attention import AttentionMetadata
from blockspec.layers.decoder import DecoderLayer, KVCache, LayerKind, decoder_stack
from blockspec.layers.linear import Linear, gemm, linear
from blockspec.layers.norm import RMSNorm
from blockspec.layers.rotary import RotaryEmbedding, layers_k, layers_kv_write
from blockspec.models.causal_lm import CausalLM
from blockspec.models.hf_config import config_problems, decoder_layer_kinds, size_problems, sliding_window
from blockspec.models.qwen3 import layer_spec
from blockspec.models.registry import DrafterKind
from blockspec.sampling import is_int, is_number

ARCHITECTURE = "DFlashDraftModel"


def dflash_value(config: PretrainedConfig, name: str, default: object = None) -> object:
    """A DFlash field: `dflash_config` first, then the top level (both forms are published)."""
    dflash = getattr(config, "dflash_config", None) or {}
    return dflash.get(name, getattr(config, name, default))


def rows_shifted(config: PretrainedConfig, default: bool) -> bool:
    """Whether block row j drafts position s+j+1 (`sample_from_anchor`, or `shift_label`), else `default`."""
    flag = dflash_value(config, "sample_from_anchor")
    flag = flag if flag is not None else dflash_value(config, "shift_label")
    return bool(flag) if flag is not None else default


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Evenly spaced from layer 1 to layer L-3 (one drafter layer: L // 2); distinct and in
    range for small targets too."""
    if num_draft_layers == 1 or num_target_layers < 3:
        return [num_target_layers // 2]
    start, end = 1, max(1, num_target_layers - 3)
    span = end - start
    return sorted({round(start + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)})


class DFlashDrafter(nn.Module):
    """Its FP8 copies (`fused_kv_fp8`, the projections, and `lm_head_fp8` of the LM head it reads)
    are made at load (`blockspec.loading.finish`). `stored`: the checkpoint's tensor names, where it
    ships its own `embed_tokens` or `lm_head` (made here to load them into)."""

    proposer = "dflash"
    shifted_by_default = False  # z-lab's rows fill in the block

    def __init__(
        self,
        config: PretrainedConfig,
        num_target_layers: int,
        target_hidden_size: int,
        stored: Collection[str] = (),
    ) -> None:
        super().__init__()
        self.config = config
        self.spec = layer_spec(config)
        n = config.num_hidden_layers
        kinds = decoder_layer_kinds(config)
        self.layer_types = [k.attention for k in kinds]
        self.sliding_window = sliding_window(config, kinds)
        self.layers = nn.ModuleList(self.decoder_layer(k) for k in kinds)
        ids = dflash_value(config, "target_layer_ids")
        self.target_layer_ids = tuple(ids if ids is not None else default_target_layer_ids(num_target_layers, n))
        h = self.spec.hidden_size
        self.fc = Linear(len(self.target_layer_ids) * target_hidden_size, h, bias=False)
        self.hidden_norm = RMSNorm(h, self.spec.eps)
        self.norm = RMSNorm(h, self.spec.eps)
        self.rotary = RotaryEmbedding(config, self.spec.head_dim)
        self.block_size = int(dflash_value(config, "block_size"))
        self.shifted = rows_shifted(config, self.shifted_by_default)
        # is_causal, as z-lab's reference reads it: true, every layer's block rows see the rows up to
        # their own; false, none is causal; unset, the sliding layers are, the full ones not
        self.is_causal = getattr(config, "is_causal", None)
        self.mask_token_id = dflash_value(config, "mask_token_id")
        self.input_embedding_scale = float(dflash_value(config, "input_embedding_scale", 1.0))
        self.output_multiplier = float(dflash_value(config, "output_multiplier", 1.0))
        self.logit_softcap = dflash_value(config, "final_logit_softcapping")
        self.draft_vocab_size = draft_vocab_size(config)
        reduced = self.draft_vocab_size < config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, h) if "embed_tokens.weight" in stored else None
        self.lm_head = Linear(h, self.draft_vocab_size, bias=False) if reduced or "lm_head.weight" in stored else None
        # target id of each draft id (d + d2t[d]); None: the draft vocabulary is the target's
        self.register_buffer(
            "draft_to_target", torch.empty(self.draft_vocab_size, dtype=torch.long) if reduced else None
        )
        self.fused_kv_weight = self.fused_kv_bias = self.fused_kv_fp8 = self.lm_head_fp8 = None  # made at load
        self.fused_kv_packed = None  # made at load on the CPU (`layers.cpu_gemm`)
        self.lm_head_packed = None  # a packed copy of the target's LM head in another dtype (`cpu_gemm`)
        self.build_heads(config)

    def build_heads(self, config: PretrainedConfig) -> None:
        """The modules a drafter kind adds after the layers and the LM head (DFlash: none)."""

    def decoder_layer(self, kind: LayerKind) -> nn.Module:
        """One of its layers (`self.config` and `self.spec` are set)."""
        return DecoderLayer(self.spec, kind)

    @property
    def num_drafts(self) -> int:
        """Drafts a block makes: one per row but the anchor's, or (shifted) one per row."""
        return self.block_size if self.shifted else self.block_size - 1

    @property
    def first_draft_row(self) -> int:
        """The block row whose output is the first draft."""
        return 0 if self.shifted else 1

    @property
    def fp8(self) -> bool:
        """Its projections and context K/V weight are FP8 copies."""
        return self.fused_kv_fp8 is not None

    def fuse_kv(self) -> None:
        """Stack every layer's k/v projection (rows [K0; V0; K1; V1; ...]) and k_norm weight.
        Call after the weights are loaded."""
        attns = [layer.self_attn for layer in self.layers]
        q = attns[0].q_size  # qkv_proj rows are q | k | v: the k|v rows are the tail
        self.fused_kv_weight = torch.cat([a.qkv_proj.weight[q:] for a in attns])
        biased = attns[0].qkv_proj.bias is not None
        self.fused_kv_bias = torch.cat([a.qkv_proj.bias[q:] for a in attns]) if biased else None
        self.k_norm_weight = torch.stack([a.k_norm.weight for a in attns])  # [L, D]
        self.fused_kv_fp8 = None  # an Fp8Linear of the same rows once `quantize_drafter` ran
        self.fused_kv_packed = None  # its packed copy for the CPU (`layers.cpu_gemm`), where loading made one

    def context_rows(self, features: torch.Tensor) -> torch.Tensor:
        """Every layer's context k and v heads before k's norm and rope, [L, *lead, 2, Hkv, D] (a
        view of one GEMM's output), from features [*lead, n*H_t]."""
        s = self.spec
        c = self.fc(features)  # hidden_norm(c) is the fused K/V GEMM's prologue
        fp8 = self.fused_kv_fp8
        if fp8 is not None:
            kv = fp8(c, norm=self.hidden_norm)
        else:
            kv = linear(c, self.fused_kv_weight, self.fused_kv_bias, self.hidden_norm, packed=self.fused_kv_packed)
        return kv.view(*c.shape[:-1], len(self.layers), 2, s.num_kv_heads, s.head_dim).movedim(-4, 0)

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's context K and V, each [L, *positions.shape, Hkv, D], from features
        [*positions.shape, n*H_t] in one GEMM. Differentiable when `fuse_kv` ran under autograd."""
        kv = self.context_rows(features)
        k = layers_k(kv, self.k_norm_weight, self.spec.eps, *self.rotary(positions, kv.dtype))
        return k, kv[..., 1, :, :]

    def write_context(
        self,
        features: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        groups: list[int],
        kv_caches: list[KVCache],
    ) -> None:
        """Append context K/V for committed positions. features: [..., n*H_t]; positions [...];
        slot_mapping [G, ...], its row groups[i] layer i's slots."""
        kv = self.context_rows(features)
        rope = self.rotary(positions, kv.dtype)
        layers_kv_write(kv_caches, kv, self.k_norm_weight, self.spec.eps, *rope, slot_mapping, groups)

    def embed(self, tokens: torch.Tensor, target: CausalLM) -> torch.Tensor:
        """The block rows' embeddings: its own copy's, or the target's."""
        if self.embed_tokens is None:
            return target.embed(tokens)
        return F.embedding(tokens, self.embed_tokens.weight)

    def forward(
        self, embeds: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata, kv_caches: list[KVCache]
    ) -> torch.Tensor:
        """embeds: the block rows' embeddings [B, S, H] (`embed`); returns normed hidden."""
        x = embeds * self.input_embedding_scale
        rope = self.rotary(positions, x.dtype)
        return decoder_stack(self.layers, x, rope, kv_caches, attn, self.norm)[0]

    def draft_logits(self, hidden: torch.Tensor, target: CausalLM) -> torch.Tensor:
        """Logits over the draft vocabulary [..., Vd] through its LM head (its own, else the target's;
        or the FP8 copy or the CPU's packed copy of it), in the head's dtype; in fp32 where the config
        scales or caps them."""
        fp8 = self.lm_head_fp8
        if fp8 is not None:
            logits = fp8(hidden)
        elif self.lm_head is not None:
            logits = self.lm_head(hidden)
        elif self.lm_head_packed is not None:  # `gemm` runs it as the target's head runs its own
            logits = gemm(hidden, target.lm_head.weight, None, packed=self.lm_head_packed)
        else:
            logits = target.compute_logits(hidden)
        if self.output_multiplier != 1.0:
            logits = logits.float() * self.output_multiplier
        if self.logit_softcap:
            logits = torch.tanh(logits.float() / self.logit_softcap) * self.logit_softcap
        return logits

    def to_target(self, logits: torch.Tensor, target: CausalLM, fill: float = float("-inf")) -> torch.Tensor:
        """Draft-vocabulary logits [..., Vd] as the target's [..., V]: `fill` at the ids the draft
        vocabulary lacks (-inf: q is zero there; 0 where they are probabilities)."""
        index = self.draft_to_target
        if index is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], target.config.vocab_size), fill)
        return full.index_copy_(-1, index, logits)

    def compute_logits(self, hidden: torch.Tensor, target: CausalLM) -> torch.Tensor:
        """Logits over the target's vocabulary [..., V]."""
        return self.to_target(self.draft_logits(hidden, target), target)

    def share_target_copies(self, target: CausalLM) -> None:
        """Drop its own embedding or LM head where it equals the target's (a copy the checkpoint
        ships, frozen in training): the target's serves, and is not held twice."""
        for name, theirs in (("embed_tokens", target.model.embed_tokens), ("lm_head", target.lm_head)):
            mine = getattr(self, name)
            if (
                mine is not None
                and mine.weight.shape == theirs.weight.shape
                and torch.equal(mine.weight, theirs.weight)
            ):
                setattr(self, name, None)

    def checkpoint_fields(self) -> dict:
        """Its own fields of config.json, z-lab's layout."""
        fields = {
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
            "input_embedding_scale": self.input_embedding_scale,
            "output_multiplier": self.output_multiplier,
            "final_logit_softcapping": self.logit_softcap,
        }
        if self.shifted:
            fields["sample_from_anchor"] = True
        reduced = {"draft_vocab_size": self.draft_vocab_size} if self.draft_to_target is not None else {}
        return {"architectures": [ARCHITECTURE], "block_size": self.block_size, **reduced, "dflash_config": fields}


def draft_vocab_size(config: PretrainedConfig) -> int:
    """Tokens it drafts from: `draft_vocab_size` where the checkpoint reduces its vocabulary (a
    draft vocabulary as large as the target's, or larger: padded, is the target's)."""
    size = dflash_value(config, "draft_vocab_size")
    return size if is_int(size) and 0 < size < config.vocab_size else config.vocab_size


def dflash_problems(config: PretrainedConfig, target: PretrainedConfig) -> list[str]:
    """What a DFlash drafter's config asks for that it cannot do against a target of config
    `target`: the DFlash fields' presence and types, then their fit, then its layers' own."""
    if sizes := size_problems(config):
        return sizes
    problems = []
    ids, mask = dflash_value(config, "target_layer_ids"), dflash_value(config, "mask_token_id")
    if ids is not None and not (isinstance(ids, list) and ids and all(is_int(i) for i in ids)):
        problems.append(f"target_layer_ids must be a non-empty list of integers, got {ids!r}")
    elif ids is not None and not all(-1 <= i < target.num_hidden_layers for i in ids):
        problems.append(
            f"target_layer_ids {ids} must be in -1..{target.num_hidden_layers - 1} (-1: the embedding output)"
        )
    if mask is None:
        problems.append("dflash_config.mask_token_id is missing")
    elif not is_int(mask):
        problems.append(f"mask_token_id must be an integer, got {mask!r}")
    elif not 0 <= mask < target.vocab_size:
        problems.append(f"mask_token_id {mask} is outside the target vocabulary (size {target.vocab_size})")
    block = dflash_value(config, "block_size")
    if not (is_int(block) and block >= 2):
        problems.append(
            "block_size is missing" if block is None else f"block_size must be an integer >= 2, got {block!r}"
        )
    n = dflash_value(config, "num_target_layers")
    if n is not None and n != target.num_hidden_layers:
        problems.append(f"trained for a target of {n} layers, this target has {target.num_hidden_layers}")
    if config.hidden_size != target.hidden_size:
        problems.append(
            f"drafter hidden_size {config.hidden_size} != target hidden_size {target.hidden_size} "
            "(the drafter reads the target's embedding and LM head)"
        )
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and vocab != target.vocab_size:
        problems.append(f"drafter vocab_size {vocab} != target vocab_size {target.vocab_size}")
    for name in ("input_embedding_scale", "output_multiplier", "final_logit_softcapping"):
        value = dflash_value(config, name)
        if value is not None and not is_number(value):
            problems.append(f"{name} must be a number, got {value!r}")
    top, nested = getattr(config, "is_causal", None), (getattr(config, "dflash_config", None) or {}).get("causal")
    if top is not None and not isinstance(top, bool):
        problems.append(f"is_causal must be true or false, got {top!r}")
    if nested is not None and nested != top:
        problems.append(
            f"dflash_config.causal {nested!r} without the same is_causal leaves the block's attention open (z-lab's "
            "reference reads is_causal only, other engines dflash_config.causal): set is_causal"
        )
    for name in ("sample_from_anchor", "shift_label"):
        value = dflash_value(config, name)
        if value is not None and not isinstance(value, bool):
            problems.append(f"{name} must be true or false, got {value!r}")
    draft_vocab = dflash_value(config, "draft_vocab_size")
    if draft_vocab is not None and not (is_int(draft_vocab) and draft_vocab > 0):
        problems.append(f"draft_vocab_size must be a positive integer, got {draft_vocab!r}")
    return problems + config_problems(config, decoder_layer_kinds(config))


def fc_problems(drafter: DFlashDrafter, weights: dict[str, torch.Tensor]) -> list[str]:
    """A checkpoint's `fc` that reads other features than the target's (another target's layers or width)."""
    fc, n = weights.get("fc.weight"), len(drafter.target_layer_ids)
    expected = drafter.fc.in_features
    if fc is None or fc.shape[-1] == expected:
        return []
    return [
        (
            f"fc.weight takes {fc.shape[-1]} inputs but {n} target layers x hidden {expected // n} = {expected}: "
            "this drafter was trained for another target"
        )
    ]


DRAFTER = DrafterKind(
    "dflash", architectures=(ARCHITECTURE,), model=DFlashDrafter, problems=dflash_problems, weight_problems=fc_problems
)
