"""The DSpark drafter (DeepSeek's `Qwen3DSparkModel`, SpecForge's `DSparkDraftModel`): DFlash's
backbone on shifted rows (row j drafts position s+j+1), and two small heads.

- Markov head: row j's logits are the LM head's plus markov_w2 . f(markov_w1[prev_j]), prev_0 the
  anchor and prev_j the token drafted from row j-1, so a block's drafts are drawn in sequence
  (`proposers.dspark`). f is the identity (`vanilla`), a gate of the row's hidden state (`gated`),
  or a recurrent state carried along the rows (`rnn`). markov_w1 is indexed by target ids,
  markov_w2 maps to the draft vocabulary.
- Confidence head: c_j = sigmoid(proj([h_j ; markov_w1[prev_j]])) (without the embedding where the
  config says so), the chance that row j's draft is accepted given that the drafts before it were.
  It reads prev_j, never row j's own draft.

DeepSeek's DFlash drafters are this model with neither head (`markov_rank` 0)."""

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from blockspec.layers.linear import Linear
from blockspec.layers.row_invariant import elementwise
from blockspec.models.dflash import DFlashDrafter, dflash_problems, dflash_value, fc_problems
from blockspec.models.registry import DrafterKind
from blockspec.sampling import is_int

ARCHITECTURES = ("Qwen3DSparkModel", "DSparkDraftModel")
MARKOV_HEADS = ("vanilla", "gated", "rnn")


class MarkovStep(NamedTuple):
    latent: torch.Tensor  # [..., r] whose projection (`MarkovHead.bias`) is added to the row's logits
    prev_embedding: torch.Tensor  # [..., r] markov_w1[prev]
    state: torch.Tensor | None  # the rnn head's state after the row


class MarkovHead(nn.Module):
    def __init__(self, kind: str, vocab_size: int, draft_vocab_size: int, rank: int, hidden_size: int) -> None:
        super().__init__()
        self.kind, self.rank = kind, rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = Linear(rank, draft_vocab_size, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        if kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def initial_state(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The state before row 0 (zero; the rnn head's only) for rows hidden [..., H]."""
        return hidden.new_zeros(*hidden.shape[:-1], self.rank) if self.kind == "rnn" else None

    def step(self, prev: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None) -> MarkovStep:
        """One row: prev [...] the token before it, hidden [..., H] its normed output."""
        e = F.embedding(prev, self.markov_w1.weight).to(hidden.dtype)
        if self.kind == "vanilla":
            latent = e
        elif self.kind == "gated":
            latent = elementwise(torch.sigmoid, self.gate_proj(torch.cat([hidden, e], -1))) * e
        else:
            gate, candidate, out = self.joint_proj(torch.cat([state, e, hidden], -1)).chunk(3, -1)
            gate = elementwise(torch.sigmoid, gate)
            state = gate * state + (1 - gate) * elementwise(torch.tanh, candidate)
            latent = elementwise(torch.tanh, out)
        return MarkovStep(latent, e, state)

    def bias(self, latent: torch.Tensor) -> torch.Tensor:
        """The logits' correction [..., Vd] of a row's latent [..., r]."""
        return self.markov_w2(latent)

    def latents(self, prev: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's latent [..., n, r] and markov_w1[prev] [..., n, r] for known previous tokens
        prev [..., n] (teacher forcing), hidden [..., n, H]; rank-sized, so that only the rows
        wanted are projected to the vocabulary."""
        if self.kind != "rnn":  # no state carried from row to row: every row in one call
            latent, e, _ = self.step(prev, hidden, None)
            return latent, e
        state, latents, embeddings = self.initial_state(hidden[..., 0, :]), [], []
        for j in range(prev.shape[-1]):
            latent, e, state = self.step(prev[..., j], hidden[..., j, :], state)
            latents.append(latent)
            embeddings.append(e)
        return torch.stack(latents, -2), torch.stack(embeddings, -2)


class ConfidenceHead(nn.Module):
    def __init__(self, features: int) -> None:
        super().__init__()
        self.proj = nn.Linear(features, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """The logit of c [...] from features [..., F]."""
        return self.proj(features)[..., 0]


class DSparkDrafter(DFlashDrafter):
    proposer = "dspark"
    shifted_by_default = True  # DeepSpec's and SpecForge's trainers label row j with position s+j+1

    def build_heads(self, config: PretrainedConfig) -> None:
        """The Markov head and the confidence head."""
        h, rank = self.spec.hidden_size, int(dflash_value(config, "markov_rank", 0))
        kind = dflash_value(config, "markov_head_type", "vanilla")
        self.markov_head = MarkovHead(kind, config.vocab_size, self.draft_vocab_size, rank, h) if rank else None
        self.confidence_with_markov = bool(dflash_value(config, "confidence_head_with_markov", False))
        confident = bool(dflash_value(config, "enable_confidence_head", False))
        self.confidence_head = ConfidenceHead(h + rank * self.confidence_with_markov) if confident else None

    def confidence_logits(self, hidden: torch.Tensor, prev_embeddings: torch.Tensor | None) -> torch.Tensor | None:
        """Each row's confidence logit [..., n] from its hidden [..., n, H] and markov_w1 of its
        previous token [..., n, r]; None without a confidence head."""
        head = self.confidence_head
        if head is None:
            return None
        features = torch.cat([hidden, prev_embeddings], -1) if self.confidence_with_markov else hidden
        return head(features).float()

    def checkpoint_fields(self) -> dict:
        """Its own fields of config.json, DeepSpec's layout (at the top level)."""
        fields = super().checkpoint_fields()
        nested = fields.pop("dflash_config")
        nested.pop("sample_from_anchor", None)  # DeepSpec's rows are shifted
        head = self.markov_head
        rows = {} if self.shifted else {"sample_from_anchor": False}
        return {
            **fields,
            **nested,
            **rows,
            "architectures": [ARCHITECTURES[0]],
            "markov_rank": head.rank if head is not None else 0,
            "markov_head_type": head.kind if head is not None else "vanilla",
            "enable_confidence_head": self.confidence_head is not None,
            "confidence_head_with_markov": self.confidence_with_markov,
        }


def dspark_problems(config: PretrainedConfig, target: PretrainedConfig) -> list[str]:
    """DFlash's problems, and the heads' fields."""
    problems = dflash_problems(config, target)
    rank, kind = dflash_value(config, "markov_rank"), dflash_value(config, "markov_head_type", "vanilla")
    if rank is None:
        problems.append("markov_rank is missing (0: no Markov head)")
    elif not (is_int(rank) and rank >= 0):
        problems.append(f"markov_rank must be an integer >= 0, got {rank!r}")
    elif rank and kind not in MARKOV_HEADS:
        problems.append(f"markov_head_type {kind!r} is not supported (supported: {', '.join(MARKOV_HEADS)})")
    for name in ("enable_confidence_head", "confidence_head_with_markov"):
        value = dflash_value(config, name)
        if value is not None and not isinstance(value, bool):
            problems.append(f"{name} must be true or false, got {value!r}")
    with_markov = dflash_value(config, "enable_confidence_head") and dflash_value(config, "confidence_head_with_markov")
    if with_markov and not rank:
        problems.append("confidence_head_with_markov needs a Markov head (markov_rank > 0)")
    projector = dflash_value(config, "projector_type")
    if projector is not None and projector != "dspark":
        problems.append(f"projector_type {projector!r} is not a DSpark drafter's (dspark)")
    if getattr(config, "model_type", None) != "qwen3":
        problems.append(
            f"model_type {getattr(config, 'model_type', None)!r}: only Qwen3 DSpark drafters are supported "
            "(DeepSeek-V4's sit inside their target's checkpoint)"
        )
    return problems


def markov_problems(drafter: DSparkDrafter, weights: dict[str, torch.Tensor]) -> list[str]:
    """fc's, and a Markov head indexed by another vocabulary than the target's."""
    problems = fc_problems(drafter, weights)
    w1 = weights.get("markov_head.markov_w1.weight")
    vocab = drafter.config.vocab_size
    if drafter.markov_head is not None and w1 is not None and w1.dim() == 2 and w1.shape[0] != vocab:
        problems.append(
            f"markov_head.markov_w1.weight embeds {w1.shape[0]} token ids but the target's vocabulary has {vocab}: "
            "the Markov head reads the previous token by its target id"
        )
    return problems


DRAFTER = DrafterKind(
    "dspark",
    architectures=ARCHITECTURES,
    model=DSparkDrafter,
    problems=dspark_problems,
    weight_problems=markov_problems,
)
