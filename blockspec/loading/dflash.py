"""DFlash drafter checkpoints in the published layout (`DFlashDraftModel`): loading with
validation against the target, and saving (sharded) so other DFlash engines load ours."""

import json
from pathlib import Path

import torch

from blockspec.layers.rotary import rope_parameters
from blockspec.loading.hf import load_config
from blockspec.loading.weights import CheckpointError, fill_module, load_weights, pack, save_sharded, unpack
from blockspec.models.dflash import DFlashDrafter
from blockspec.models.llama import CausalLM

ARCHITECTURE = "DFlashDraftModel"


def validate(drafter: DFlashDrafter, target: CausalLM, source: Path) -> None:
    tc = target.config
    problems = []
    if drafter.mask_token_id is None:
        problems.append("dflash_config.mask_token_id is missing")
    elif not 0 <= drafter.mask_token_id < tc.vocab_size:
        problems.append(
            f"mask_token_id {drafter.mask_token_id} is outside the target vocabulary (size {tc.vocab_size})"
        )
    bad = [i for i in drafter.target_layer_ids if not 0 <= i < tc.num_hidden_layers]
    if bad or not drafter.target_layer_ids:
        problems.append(f"target_layer_ids {list(drafter.target_layer_ids)} must be in 0..{tc.num_hidden_layers - 1}")
    if drafter.spec.hidden_size != tc.hidden_size:
        problems.append(
            f"drafter hidden_size {drafter.spec.hidden_size} != target hidden_size {tc.hidden_size} "
            "(the drafter reads the target's embedding and LM head)"
        )
    vocab = getattr(drafter.config, "vocab_size", None)
    if vocab is not None and vocab != tc.vocab_size:
        problems.append(f"drafter vocab_size {vocab} != target vocab_size {tc.vocab_size}")
    if drafter.block_size < 2:
        problems.append(f"block_size must be >= 2, got {drafter.block_size}")
    if problems:
        raise CheckpointError(f"{source}: drafter does not fit the target: " + "; ".join(problems))


def load_drafter(path: str | Path, target: CausalLM, dtype: torch.dtype, device: torch.device) -> DFlashDrafter:
    path = Path(path)
    config = load_config(path)
    arch = (getattr(config, "architectures", None) or ["?"])[0]
    if arch != ARCHITECTURE:
        raise CheckpointError(f"{path}: architecture {arch} is not a DFlash drafter ({ARCHITECTURE})")
    tc = target.config
    with torch.device("meta"):
        drafter = DFlashDrafter(config, tc.num_hidden_layers, tc.hidden_size)
    validate(drafter, target, path)
    weights = load_weights(path)
    fc = weights.get("fc.weight")
    expected = len(drafter.target_layer_ids) * tc.hidden_size
    if fc is not None and fc.shape[-1] != expected:
        raise CheckpointError(
            f"{path}: fc.weight takes {fc.shape[-1]} inputs but {len(drafter.target_layer_ids)} target layers "
            f"x hidden {tc.hidden_size} = {expected}: this drafter was trained for another target"
        )
    fill_module(drafter, pack(weights, path), dtype, device, path)
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
        "block_size": drafter.block_size,
        "num_target_layers": target.config.num_hidden_layers,
        "dflash_config": {"mask_token_id": drafter.mask_token_id, "target_layer_ids": list(drafter.target_layer_ids)},
    }


def save_drafter(
    drafter: DFlashDrafter,
    target: CausalLM,
    path: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = 15 * 2**20,
) -> None:
    path = Path(path)
    s = drafter.spec
    sizes = {
        "qkv_proj": [s.num_heads * s.head_dim] + [s.num_kv_heads * s.head_dim] * 2,
        "gate_up_proj": [s.intermediate_size] * 2,
    }
    weights = unpack({n: p.detach().to("cpu", dtype) for n, p in drafter.named_parameters()}, sizes)
    save_sharded(weights, path, max_shard_bytes)
    config = {**drafter_config(drafter, target), "torch_dtype": str(dtype).removeprefix("torch.")}
    (path / "config.json").write_text(json.dumps(config, indent=2))
