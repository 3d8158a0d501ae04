"""Drafter checkpoints: loading a drafter of any registered kind (`DrafterKind`) with validation
against its target, and saving DFlash drafters in the published layout (`DFlashDraftModel`,
sharded) so that other DFlash engines load ours."""

import json
from pathlib import Path

import torch
from transformers import PretrainedConfig

from blockspec.layers.decoder import packed_parts
from blockspec.layers.rotary import rope_parameters
from blockspec.loading.finish import AS_STORED, LoadOptions, finish_drafter
from blockspec.loading.hf import GEOMETRY_FIELDS, load_config
from blockspec.loading.weights import CheckpointError, fill_module, load_weights, save_sharded, unpack
from blockspec.models.causal_lm import CausalLM
from blockspec.models.dflash import ARCHITECTURE, DFlashDrafter
from blockspec.models.registry import Drafter, DrafterKind, drafter_kind_for


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


def load_drafter(
    path: str | Path, target: CausalLM, dtype: torch.dtype, device: torch.device, options: LoadOptions = AS_STORED
) -> Drafter:
    """The drafter of a directory, for `target`, its derived weights made as `options` ask (`finish_drafter`)."""
    path = Path(path)
    config = load_config(path, GEOMETRY_FIELDS)
    kind = validate(config, target, path)
    with torch.device("meta"):
        drafter = kind.build(config, target)
    weights = load_weights(path)
    problems = kind.weight_problems(drafter, weights)
    if problems:
        raise CheckpointError(f"{path}: " + "; ".join(problems))
    fill_module(drafter, kind.weights.to_model(weights, drafter.spec, path), dtype, device, path)
    drafter.rotary.to(device)
    return finish_drafter(drafter, target, options)


def drafter_config(drafter: DFlashDrafter, target: CausalLM) -> dict:
    """config.json of the published layout."""
    s, rope = drafter.spec, rope_parameters(drafter.config)
    return {
        "architectures": [ARCHITECTURE],
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
        "block_size": drafter.block_size,
        "num_target_layers": target.config.num_hidden_layers,
        "dflash_config": {
            "mask_token_id": drafter.mask_token_id,
            "target_layer_ids": list(drafter.target_layer_ids),
            "input_embedding_scale": drafter.input_embedding_scale,
            "output_multiplier": drafter.output_multiplier,
            "final_logit_softcapping": drafter.logit_softcap,
        },
    }


def save_drafter(
    drafter: DFlashDrafter,
    target: CausalLM,
    path: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = 15 * 2**20,
) -> None:
    if drafter.fp8:  # FP8 projections hold no parameters to save
        raise ValueError(
            "this drafter was quantized to FP8 for inference (fp8='on'/'auto'): save it before, or load it with fp8='off'"
        )
    path = Path(path)
    weights = {n: p.detach().to("cpu", dtype) for n, p in drafter.named_parameters()}
    weights = unpack(weights, packed_parts(drafter.spec))
    save_sharded(weights, path, max_shard_bytes)
    config = {**drafter_config(drafter, target), "torch_dtype": str(dtype).removeprefix("torch.")}
    (path / "config.json").write_text(json.dumps(config, indent=2))
