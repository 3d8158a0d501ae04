"""Drafter checkpoints: loading a drafter of any registered kind (`DrafterKind`), in any published
dialect (`blockspec.models.dialects`), with validation against its target; and saving ours in a
published layout (z-lab's `DFlashDraftModel`, or DeepSpec's `Qwen3DSparkModel` for shifted rows
and DSpark heads), sharded, so that other engines load them."""

import json
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import AutoConfig, PretrainedConfig

from blockspec.layers.decoder import packed_parts
from blockspec.layers.rotary import rope_parameters
from blockspec.loading.finish import AS_STORED, LoadOptions, finish_drafter
from blockspec.loading.hf import GEOMETRY_FIELDS
from blockspec.loading.weights import (
    CheckpointError,
    check_tensors,
    checkpoint_dir,
    fill_module,
    load_weights,
    read_json,
    save_sharded,
    unpack,
)
from blockspec.models.causal_lm import CausalLM
from blockspec.models.dflash import DFlashDrafter
from blockspec.models.dialects import Dialect, dialect_of
from blockspec.models.registry import Drafter, DrafterKind, drafter_kind_for


def read_drafter_config(raw: dict, source: Path | str, target_vocab: int) -> tuple[PretrainedConfig, Dialect]:
    """A drafter's config.json, read in its dialect (`blockspec.models.dialects`); without a
    vocab_size, the target's (`target_vocab`: the drafter drafts over it, not transformers' default)."""
    if not isinstance(raw, dict):
        raise CheckpointError(f"{source}: expected a JSON object")
    dialect = dialect_of(raw)
    try:
        fields = dialect.read(raw)
    except ValueError as e:
        raise CheckpointError(f"{source}: {e}") from None
    missing = [f for f in GEOMETRY_FIELDS if f not in fields]
    if missing:
        raise CheckpointError(f"{source}: fields missing: {', '.join(missing)}")
    fields = {"vocab_size": target_vocab} | fields
    model_type = fields.get("model_type", "qwen3")
    try:
        config = AutoConfig.for_model(model_type, **{k: v for k, v in fields.items() if k != "model_type"})
    except Exception as e:  # transformers raises many kinds; all mean the same here
        raise CheckpointError(f"{source}: not a usable model config ({e})") from e
    return config, dialect


def validate(config: PretrainedConfig, target: CausalLM, source: Path | str) -> DrafterKind:
    """The registered kind of a drafter config, checked against its target before a drafter is
    built from it (loading, and training's own config)."""
    try:
        kind = drafter_kind_for(config)
    except ValueError as e:  # the registry's one error: no drafter of that architecture
        raise CheckpointError(f"{source}: {e}") from None
    problems = kind.problems(config, target.config)
    if problems:
        raise CheckpointError(f"{source}: drafter config does not fit the target: " + "; ".join(problems))
    return kind


def draft_to_target(
    drafter: Drafter, d2t: torch.Tensor | None, t2d: torch.Tensor | None, vocab: int, source: Path
) -> torch.Tensor | None:
    """The target id of each draft id (d + d2t[d]) of a reduced-vocabulary drafter, checked: one
    distinct target id each (and t2d, where shipped, marking exactly those); None for a full one."""
    size = drafter.draft_vocab_size
    if size == vocab:
        if d2t is not None and not (d2t.shape == (vocab,) and not d2t.any()):
            raise CheckpointError(f"{source}: d2t remaps a draft vocabulary that is the target's ({vocab} tokens)")
        return None
    if d2t is None:
        raise CheckpointError(
            f"{source}: draft_vocab_size {size} < the target's {vocab} needs the d2t tensor (draft id -> target "
            "id offsets), which the checkpoint lacks"
        )
    if d2t.dtype.is_floating_point or d2t.shape != (size,):
        raise CheckpointError(
            f"{source}: d2t must be integer offsets of shape ({size},), got {d2t.dtype} {tuple(d2t.shape)}"
        )
    ids = torch.arange(size) + d2t.long()
    if ids.min() < 0 or ids.max() >= vocab or ids.unique().numel() != size:
        raise CheckpointError(f"{source}: d2t maps draft ids outside the target vocabulary, or two to one id")
    if t2d is not None and not (t2d.shape == (vocab,) and torch.equal(t2d.nonzero()[:, 0], ids.sort().values)):
        raise CheckpointError(f"{source}: t2d does not mark the target ids that d2t maps to")
    return ids


class MetaDrafter(NamedTuple):
    """A checkpoint's drafter built on the meta device, and its tensors as the drafter's parameters
    (checked: every one there, none left over, each of its shape) and vocabulary maps."""

    drafter: Drafter
    params: dict[str, torch.Tensor]
    d2t: torch.Tensor | None
    t2d: torch.Tensor | None


def build_drafter(raw: dict, tensors: dict[str, torch.Tensor], target: CausalLM, source: Path) -> MetaDrafter:
    """The drafter of config.json `raw` and checkpoint `tensors` (their names as stored) for
    `target`, on the meta device."""
    config, dialect = read_drafter_config(raw, source / "config.json", target.config.vocab_size)
    kind = validate(config, target, source)
    weights = {new: t for name, t in tensors.items() if (new := dialect.rename(name)) is not None}
    d2t, t2d = weights.pop("d2t", None), weights.pop("t2d", None)
    with torch.device("meta"):
        drafter = kind.build(config, target, stored=weights.keys())
    problems = kind.weight_problems(drafter, weights)
    if problems:
        raise CheckpointError(f"{source}: " + "; ".join(problems))
    params = kind.weights.to_model(weights, drafter.spec, source)
    check_tensors(drafter, params, source, packing=kind.weights.packing(drafter.spec))
    return MetaDrafter(drafter, params, d2t, t2d)


def load_drafter(
    path: str | Path, target: CausalLM, dtype: torch.dtype, device: torch.device, options: LoadOptions = AS_STORED
) -> Drafter:
    """The drafter of a directory, in any dialect, for `target`, its derived weights made as
    `options` ask (`finish_drafter`). Copies of the target's embedding or LM head that it ships
    are checked and then shared."""
    path = checkpoint_dir(path)
    drafter, params, d2t, t2d = build_drafter(read_json(path / "config.json"), load_weights(path), target, path)
    ids = draft_to_target(drafter, d2t, t2d, target.config.vocab_size, path)
    fill_module(drafter, params, dtype, device, path)
    drafter.rotary.to(device)
    if ids is not None:
        drafter.draft_to_target = ids.to(device)
    drafter.share_target_copies(target)
    return finish_drafter(drafter, target, options)


def published_config(drafter: DFlashDrafter, target: CausalLM) -> dict:
    """config.json of its published layout (`checkpoint_fields`)."""
    s, rope = drafter.spec, rope_parameters(drafter.config)
    return {
        "model_type": "qwen3",
        "hidden_size": s.hidden_size,
        "num_hidden_layers": len(drafter.layers),
        "num_attention_heads": s.num_heads,
        "num_key_value_heads": s.num_kv_heads,
        "head_dim": s.head_dim,
        "intermediate_size": s.intermediate_size,
        "rms_norm_eps": s.eps,
        "attention_bias": s.qkv_bias,
        "hidden_act": "silu",
        "vocab_size": target.config.vocab_size,
        "max_position_embeddings": target.config.max_position_embeddings,
        "rope_theta": rope["rope_theta"],
        "rope_scaling": None
        if rope["rope_type"] == "default"
        else {k: v for k, v in rope.items() if k != "rope_theta"},
        "tie_word_embeddings": False,
        "layer_types": drafter.layer_types,
        "use_sliding_window": drafter.sliding_window is not None,  # transformers drops sliding_window without it
        "sliding_window": drafter.sliding_window,
        **({"is_causal": drafter.is_causal} if drafter.is_causal is not None else {}),
        "num_target_layers": target.config.num_hidden_layers,
        **drafter.checkpoint_fields(),
    }


def save_drafter(
    drafter: DFlashDrafter,
    target: CausalLM,
    path: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = 15 * 2**20,
) -> None:
    """`drafter`'s weights in `dtype` (shards of at most `max_shard_bytes`) and config.json in its
    published layout (`published_config`), with `d2t` where its vocabulary is reduced."""
    if drafter.fp8:  # FP8 projections hold no parameters to save
        raise ValueError(
            "this drafter was quantized to FP8 for inference (fp8='on'/'auto'): save it before, or load it with fp8='off'"
        )
    path = Path(path)
    weights = {n: p.detach().to("cpu", dtype) for n, p in drafter.named_parameters()}
    weights = unpack(weights, packed_parts(drafter.spec))
    if drafter.draft_to_target is not None:  # stored as offsets
        ids = drafter.draft_to_target.cpu()
        weights["d2t"] = ids - torch.arange(len(ids))
    save_sharded(weights, path, max_shard_bytes)
    config = {**published_config(drafter, target), "torch_dtype": str(dtype).removeprefix("torch.")}
    (path / "config.json").write_text(json.dumps(config, indent=2))
