"""The model registry: a record per target family (`TargetFamily`) and per drafter kind
(`DrafterKind`), each declared at module level in its own module of `blockspec.models`, where the
registry finds it: a new family or drafter is one new file. Loading picks the record by the
architecture config.json names (`family_for`, `drafter_kind_for`) and builds through it."""

import functools
import importlib
import pkgutil
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch
from torch import nn
from transformers import PretrainedConfig

from blockspec.layers.attention import AttentionMetadata
from blockspec.layers.decoder import MIXERS, RECURRENT_STATE, KVCache, LayerKind, LayerSpec
from blockspec.loading.weights import WeightMapping
from blockspec.models.causal_lm import CausalLM
from blockspec.models.hf_config import config_problems, decoder_layer_kinds, size_problems


@dataclass(frozen=True)
class TargetFamily:
    """A family of targets: the config.json that selects it (`architectures`, or where it names
    none, `model_types`), its config read as our layer spec and per-layer kinds (mixer: full or
    sliding attention; MLP: dense or sparse_moe), its checkpoint names mapped to ours, and the model built."""

    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    layer_spec: Callable[[PretrainedConfig], LayerSpec]
    layer_kinds: Callable[[PretrainedConfig], list[LayerKind]] = decoder_layer_kinds
    weights: WeightMapping = field(default_factory=WeightMapping)
    model: type[CausalLM] = CausalLM  # built as model(config, layer_spec(config), layer_kinds(config))

    def problems(self, config: PretrainedConfig) -> list[str]:
        """What `config` asks for that this family's model cannot do."""
        if sizes := size_problems(config):
            return sizes
        spec, kinds = self.layer_spec(config), self.layer_kinds(config)
        parts = [p for p in (spec.moe, spec.linear_attention) if p is not None]
        problems = config_problems(config, kinds) + [problem for p in parts for problem in p.problems()]
        if spec.linear_attention is None and any(k.attention in MIXERS and k.cache == RECURRENT_STATE for k in kinds):
            problems.append(f"{self.name} has no linear-attention layers: its layer_types name them")
        return problems

    def cache_kinds(self, config: PretrainedConfig) -> tuple[str, ...]:
        """The caches its layers keep of each sequence (`LayerKind.cache`), each once; of a config
        without `problems`."""
        return tuple(dict.fromkeys(k.cache for k in self.layer_kinds(config)))

    def build(self, config: PretrainedConfig) -> CausalLM:
        """The model of `config` (a config without `problems`), on the current default device."""
        return self.model(config, self.layer_spec(config), self.layer_kinds(config))


class Drafter(Protocol):
    """What the engine runs a drafter by, whatever its kind."""

    proposer: ClassVar[str]  # the engine's proposer of its drafts
    spec: LayerSpec
    layers: nn.ModuleList
    block_size: int  # rows of the block it drafts
    num_drafts: int  # drafts a block makes (block_size - 1, or block_size where its rows are shifted)
    first_draft_row: int  # the block row whose output is the first draft
    mask_token_id: int
    target_layer_ids: tuple[int, ...]  # the target layers whose outputs are its context features
    sliding_window: int | None
    fp8: bool  # its projections are FP8 copies (made at load)
    lm_head: nn.Module | None  # its own LM head (None: it reads the target's)

    def __call__(
        self, embeds: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata, kv_caches: list[KVCache]
    ) -> torch.Tensor: ...

    def embed(self, tokens: torch.Tensor, target: CausalLM) -> torch.Tensor: ...

    def draft_logits(self, hidden: torch.Tensor, target: CausalLM) -> torch.Tensor:
        """Over its draft vocabulary."""

    def to_target(self, logits: torch.Tensor, target: CausalLM) -> torch.Tensor:
        """Draft-vocabulary logits over the target's vocabulary."""

    def compute_logits(self, hidden: torch.Tensor, target: CausalLM) -> torch.Tensor: ...

    def write_context(
        self,
        features: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        groups: list[int],
        kv_caches: list[KVCache],
    ) -> None: ...

    def fuse_kv(self) -> None:
        """Derive the weights its context GEMM reads from its loaded parameters."""


@dataclass(frozen=True)
class DrafterKind:
    """A kind of drafter: the architectures that select it, its model class, what of its config it
    cannot run against its target's, what of a checkpoint's tensors do not fit that target, and
    its checkpoint names mapped to ours."""

    name: str
    architectures: tuple[str, ...]
    model: type[Drafter]  # built as model(config, target layers, target hidden size, checkpoint tensor names)
    problems: Callable[[PretrainedConfig, PretrainedConfig], list[str]]  # (its config, the target's)
    weight_problems: Callable[[Drafter, dict[str, torch.Tensor]], list[str]]  # (the drafter built, its tensors)
    weights: WeightMapping = field(default_factory=WeightMapping)

    @property
    def proposer(self) -> str:
        return self.model.proposer

    def build(self, config: PretrainedConfig, target: CausalLM, stored: Collection[str] = ()) -> Drafter:
        """The drafter of `config` for `target`, on the current default device, with the modules
        of the optional tensors its checkpoint `stored` (its own embedding or LM head)."""
        return self.model(config, target.config.num_hidden_layers, target.config.hidden_size, stored)


@functools.cache
def registered() -> tuple[tuple[TargetFamily, ...], tuple[DrafterKind, ...]]:
    """Every record that a module of `blockspec.models` declares at module level, each
    architecture claimed by one record only."""
    import blockspec.models as package

    records: dict[int, TargetFamily | DrafterKind] = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        records.update((id(v), v) for v in vars(module).values() if isinstance(v, TargetFamily | DrafterKind))
    owners: dict[str, str] = {}
    for record in records.values():
        for arch in record.architectures:
            if arch in owners:
                raise ValueError(f"architecture {arch} is claimed by both {owners[arch]} and {record.name}")
            owners[arch] = record.name
    families = tuple(r for r in records.values() if isinstance(r, TargetFamily))
    return families, tuple(r for r in records.values() if isinstance(r, DrafterKind))


def target_families() -> tuple[TargetFamily, ...]:
    return registered()[0]


def drafter_kinds() -> tuple[DrafterKind, ...]:
    return registered()[1]


def architecture(config: PretrainedConfig) -> str | None:
    """The class config.json names, or None where it names none (transformers then goes by model_type);
    ValueError where `architectures` is not a list of names."""
    names = getattr(config, "architectures", None) or [None]
    if not isinstance(names, list) or not isinstance(names[0], str | None):
        raise ValueError(f"architectures must be a list of class names, got {names!r}")  # noqa: TRY004 (callers name the file)
    return names[0]


def supported(records: tuple[TargetFamily, ...] | tuple[DrafterKind, ...]) -> str:
    return ", ".join(sorted(a for r in records for a in r.architectures))


def family_for(config: PretrainedConfig) -> TargetFamily:
    """The family of the architecture config.json names or, where it names none, of its
    model_type; ValueError naming the supported ones where none is registered."""
    families, arch = target_families(), architecture(config)
    if arch is not None:
        found = next((f for f in families if arch in f.architectures), None)
        if found is None:
            raise ValueError(f"architecture {arch} is not supported (supported: {supported(families)})")
        return found
    model_type = getattr(config, "model_type", None)
    found = next((f for f in families if model_type in f.model_types), None)
    if found is None:
        types = ", ".join(sorted(t for f in families for t in f.model_types))
        raise ValueError(
            f"config.json names no architecture, and model_type {model_type!r} is not supported (supported: {types})"
        )
    return found


def drafter_kind_for(config: PretrainedConfig) -> DrafterKind:
    """The drafter kind of the architecture config.json names; ValueError naming the supported ones
    where none is registered."""
    kinds, arch = drafter_kinds(), architecture(config)
    found = next((k for k in kinds if arch in k.architectures), None)
    if found is None:
        named = f"architecture {arch}" if arch else "config.json names no architecture, so it"
        raise ValueError(f"{named} is not a supported drafter (supported: {supported(kinds)})")
    return found
