"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B): Qwen3's attention; the MLP of layer i is sparse
(softmax router, top `num_experts_per_tok` of `num_experts`, renormalized where `norm_topk_prob`)
when i is not in `mlp_only_layers` and (i + 1) is a multiple of `decoder_sparse_step`, else dense.
Checkpoints store each expert's projections apart; loading stacks them per layer."""

import dataclasses
import re
from pathlib import Path

import torch
from transformers import PretrainedConfig

from blockspec.layers.decoder import LayerKind, LayerSpec
from blockspec.layers.moe import MoESpec
from blockspec.loading.weights import CheckpointError, WeightMapping, stored_name
from blockspec.models.hf_config import layer_types
from blockspec.models.qwen3 import layer_spec as qwen3_spec
from blockspec.models.registry import TargetFamily

EXPERT = re.compile(r"(.+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")


def layer_spec(config: PretrainedConfig) -> LayerSpec:
    if config.num_experts == 0:  # every MLP dense (`is_sparse`)
        return qwen3_spec(config)
    moe = MoESpec(
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.moe_intermediate_size,
        routing="softmax_topk",
        norm_topk_prob=bool(config.norm_topk_prob),
    )
    return dataclasses.replace(qwen3_spec(config), moe=moe)


def is_sparse(config: PretrainedConfig, i: int) -> bool:
    """Layer i's MLP is sparse (a config without `decoder_sparse_step`: every layer's, Qwen3.5-MoE)."""
    dense = getattr(config, "mlp_only_layers", None) or []
    step = getattr(config, "decoder_sparse_step", 1)
    if not (isinstance(step, int) and step >= 1):
        raise ValueError(f"decoder_sparse_step must be a positive integer, got {step!r}")
    return i not in dense and (getattr(config, "num_experts", 0) or 0) > 0 and (i + 1) % step == 0


def layer_kinds(config: PretrainedConfig) -> list[LayerKind]:
    """Each layer's attention (`layer_types`) and MLP (`is_sparse`)."""
    return [LayerKind(t, "sparse_moe" if is_sparse(config, i) else "dense") for i, t in enumerate(layer_types(config))]


def rename(name: str) -> str | None:
    return stored_name(name.replace(".mlp.gate.weight", ".mlp.router.weight"))


def stack_experts(weights: dict[str, torch.Tensor], spec: LayerSpec, source: Path) -> dict[str, torch.Tensor]:
    """Each layer's `experts.{e}.{gate,up,down}_proj.weight` -> `experts.gate_up_proj` [E, 2I, H] and
    `experts.down_proj` [E, H, I]; the per-expert tensors leave `weights` as they are stacked."""
    if spec.moe is None:  # no sparse layer: expert tensors are the checkpoint's mismatch (`check_tensors`)
        return weights
    I, H = spec.moe.intermediate_size, spec.hidden_size  # an expert's width, the hidden size
    shapes = {"gate": (I, H), "up": (I, H), "down": (H, I)}  # each expert's, as stored
    layers: dict[str, dict[tuple[str, int], str]] = {}
    for name in list(weights):
        if (m := EXPERT.fullmatch(name)) is not None:
            layers.setdefault(m[1], {})[m[3], int(m[2])] = name
    for prefix, names in layers.items():
        if f"{prefix}.gate_up_proj" in weights:
            raise CheckpointError(f"{source}: {prefix} is stored twice: per expert and stacked")
        experts = range(spec.moe.num_experts)
        expected = {(part, e) for part in ("gate", "up", "down") for e in experts}
        if set(names) != expected:
            missing, extra = sorted(expected - set(names)), sorted(set(names) - expected)
            raise CheckpointError(f"{source}: {prefix}: expert tensors missing {missing[:4]}, unexpected {extra[:4]}")
        part = {key: weights.pop(name) for key, name in names.items()}
        for (kind, e), name in names.items():
            if tuple(part[kind, e].shape) != shapes[kind]:
                raise CheckpointError(
                    f"{source}: {name} has shape {tuple(part[kind, e].shape)}, expected {shapes[kind]}"
                )
        weights[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([part["gate", e], part["up", e]]) for e in experts])
        weights[f"{prefix}.down_proj"] = torch.stack([part["down", e] for e in experts])
    return weights


FAMILY = TargetFamily(
    "qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    model_types=("qwen3_moe",),
    layer_spec=layer_spec,
    layer_kinds=layer_kinds,
    weights=WeightMapping(rename=rename, convert=stack_experts),
)
