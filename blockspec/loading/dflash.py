"""DFlash drafter checkpoints in the published layout (`DFlashDraftModel`): loading with
validation against the target, and saving (sharded) so other DFlash engines load ours."""

import json
from pathlib import Path

import torch

from blockspec.layers.quantization import Fp8Linear
from blockspec.layers.rotary import rope_parameters
from blockspec.loading.hf import GEOMETRY_FIELDS, architecture, load_config
from blockspec.loading.weights import CheckpointError, fill_module, load_weights, pack, save_sharded, unpack
from blockspec.models.dflash import DFlashDrafter, dflash_value
from blockspec.models.llama import CausalLM, config_problems, packed_sizes
from blockspec.sampling import is_int, is_number

ARCHITECTURE = "DFlashDraftModel"


def validate(config, target: CausalLM, source: Path | str) -> None:
    """A drafter config against its target, before a drafter is built from it (loading, and
    training's own config): the DFlash fields' presence and types, then their fit."""
    tc, problems = target.config, []
    ids, mask = dflash_value(config, "target_layer_ids"), dflash_value(config, "mask_token_id")
    if ids is not None and not (isinstance(ids, list) and ids and all(is_int(i) for i in ids)):
        problems.append(f"target_layer_ids must be a non-empty list of integers, got {ids!r}")
    elif ids is not None and not all(0 <= i < tc.num_hidden_layers for i in ids):
        problems.append(f"target_layer_ids {ids} must be in 0..{tc.num_hidden_layers - 1}")
    if mask is None:
        problems.append("dflash_config.mask_token_id is missing")
    elif not is_int(mask):
        problems.append(f"mask_token_id must be an integer, got {mask!r}")
    elif not 0 <= mask < tc.vocab_size:
        problems.append(f"mask_token_id {mask} is outside the target vocabulary (size {tc.vocab_size})")
    block = dflash_value(config, "block_size")
    if not (is_int(block) and block >= 2):
        problems.append(
            "block_size is missing" if block is None else f"block_size must be an integer >= 2, got {block!r}"
        )
    n = dflash_value(config, "num_target_layers")
    if n is not None and n != tc.num_hidden_layers:
        problems.append(f"trained for a target of {n} layers, this target has {tc.num_hidden_layers}")
    if config.hidden_size != tc.hidden_size:
        problems.append(
            f"drafter hidden_size {config.hidden_size} != target hidden_size {tc.hidden_size} "
            "(the drafter reads the target's embedding and LM head)"
        )
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and vocab != tc.vocab_size:
        problems.append(f"drafter vocab_size {vocab} != target vocab_size {tc.vocab_size}")
    for name in ("input_embedding_scale", "output_multiplier", "final_logit_softcapping"):
        value = dflash_value(config, name)
        if value is not None and not is_number(value):
            problems.append(f"{name} must be a number, got {value!r}")
    problems += config_problems(config)
    if problems:
        raise CheckpointError(f"{source}: drafter config does not fit the target: " + "; ".join(problems))


def load_drafter(path: str | Path, target: CausalLM, dtype: torch.dtype, device: torch.device) -> DFlashDrafter:
    path = Path(path)
    config = load_config(path, GEOMETRY_FIELDS)
    arch = architecture(config)
    if arch != ARCHITECTURE:
        named = f"architecture {arch}" if arch else "config.json names no architecture, so it"
        raise CheckpointError(f"{path}: {named} is not a DFlash drafter ({ARCHITECTURE})")
    tc = target.config
    validate(config, target, path)
    with torch.device("meta"):
        drafter = DFlashDrafter(config, tc.num_hidden_layers, tc.hidden_size)
    weights = load_weights(path)
    fc = weights.get("fc.weight")
    expected = len(drafter.target_layer_ids) * tc.hidden_size
    if fc is not None and fc.shape[-1] != expected:
        raise CheckpointError(
            f"{path}: fc.weight takes {fc.shape[-1]} inputs but {len(drafter.target_layer_ids)} target layers "
            f"x hidden {tc.hidden_size} = {expected}: this drafter was trained for another target"
        )
    fill_module(drafter, pack(weights, path, packed_sizes(drafter.spec)), dtype, device, path)
    drafter.rotary.to(device)
    drafter.fuse_kv()
    return drafter.eval()


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
    if any(isinstance(m, Fp8Linear) for m in drafter.modules()):  # its projections are buffers now
        raise ValueError(
            "this drafter was quantized to FP8 for inference (fp8='on'/'auto'): save it before, or load it with fp8='off'"
        )
    path = Path(path)
    weights = {n: p.detach().to("cpu", dtype) for n, p in drafter.named_parameters()}
    weights = unpack(weights, packed_sizes(drafter.spec))
    save_sharded(weights, path, max_shard_bytes)
    config = {**drafter_config(drafter, target), "torch_dtype": str(dtype).removeprefix("torch.")}
    (path / "config.json").write_text(json.dumps(config, indent=2))
