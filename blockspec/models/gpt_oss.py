"""gpt-oss: biased q/k/v/o projections and a learned sink logit per head in every attention softmax;
sliding (window `sliding_window`, 128) and full attention layers as `layer_types` alternate them;
YaRN rope; every MLP sparse: a biased router whose top `num_experts_per_tok` logits are
softmaxed, and biased experts with the clamped SwiGLU (`MoESpec.activation`).

Checkpoints come in two layouts, both loaded here: OpenAI's, the experts in MXFP4
(`*_blocks`/`*_scales`: kept so with `LoadOptions.mxfp4_experts`, else dequantized exactly at load,
`blockspec.layers.mxfp4`), and transformers' dequantized one (`experts.gate_up_proj` [E, H, 2I], `experts.down_proj` [E, I, H]). Both store
gate|up with gate and up interleaved column by column; ours puts the gate rows first."""

import dataclasses
import re
from pathlib import Path

import torch
from transformers import PretrainedConfig

from blockspec.layers.decoder import LayerKind, LayerSpec
from blockspec.layers.moe import MoESpec
from blockspec.layers.mxfp4 import mxfp4_problems
from blockspec.loading.weights import CheckpointError, WeightMapping
from blockspec.models.hf_config import decoder_spec, layer_types
from blockspec.models.registry import TargetFamily

EXPERTS = re.compile(r"(.+\.experts)\.gate_up_proj(_blocks)?")  # a layer's experts, in either layout


def layer_spec(config: PretrainedConfig) -> LayerSpec:
    moe = MoESpec(
        num_experts=config.num_local_experts,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.intermediate_size,
        routing="topk_softmax",
        router_bias=True,
        expert_bias=True,
        activation="clamped_swiglu",
        swiglu_alpha=getattr(config, "swiglu_alpha", 1.702),
        swiglu_limit=getattr(config, "swiglu_limit", 7.0),
    )
    bias = getattr(config, "attention_bias", True)
    return dataclasses.replace(decoder_spec(config, qkv_bias=bias, o_bias=bias), attention_sinks=True, moe=moe)


def layer_kinds(config: PretrainedConfig) -> list[LayerKind]:
    return [LayerKind(t, "sparse_moe") for t in layer_types(config)]


def gate_first(gate_up: torch.Tensor, dim: int) -> torch.Tensor:
    """Interleaved gate|up (gate at the even indices of `dim`) -> the gate half, then the up half."""
    pairs = gate_up.unflatten(dim, (-1, 2))
    return torch.cat([pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)], dim)


def take(weights: dict[str, torch.Tensor], name: str, shape: tuple[int, ...], source: Path) -> torch.Tensor:
    """A tensor of the checkpoint, removed from `weights`, checked to have the `shape` it is stored in."""
    if name not in weights:
        raise CheckpointError(f"{source}: tensors missing from the checkpoint: {[name]}")
    tensor = weights.pop(name)
    if tuple(tensor.shape) != shape:
        raise CheckpointError(f"{source}: {name} has shape {tuple(tensor.shape)}, expected {shape}")
    return tensor


def mxfp4_pair(
    weights: dict[str, torch.Tensor], prefix: str, shape: tuple[int, int, int], source: Path
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MXFP4 weight `prefix` of `shape` [E, N, K] as stored: its (blocks, scales), checked."""
    groups = (*shape[:2], shape[2] // 32)
    blocks, scales = (
        take(weights, f"{prefix}_blocks", (*groups, 16), source),
        take(weights, f"{prefix}_scales", groups, source),
    )
    problems = mxfp4_problems(blocks, scales)
    if problems:
        raise CheckpointError(f"{source}: {prefix}: " + "; ".join(problems))
    return blocks, scales


def expert_layout(weights: dict[str, torch.Tensor], spec: LayerSpec, source: Path) -> dict[str, torch.Tensor]:
    """Each layer's experts in ours: gate_up_proj [E, 2I, H] gate rows first, down_proj [E, H, I] (or,
    stored in MXFP4, the same rows as `gate_up_blocks`/`_scales` and `down_blocks`/`_scales`, as
    `Experts` holds them: loading dequantizes them where the model keeps bf16 experts), and the
    biases (`gate_up_bias`, `down_bias`)."""
    E, I, H = spec.moe.num_experts, spec.moe.intermediate_size, spec.hidden_size  # experts, their width, hidden
    for experts in sorted({m[1] for n in weights if (m := EXPERTS.fullmatch(n))}):
        prefix = f"{experts}.gate_up_proj"
        if f"{prefix}_blocks" in weights and prefix in weights:
            raise CheckpointError(f"{source}: {prefix} is stored twice: in MXFP4 and dense")
        if f"{prefix}_blocks" in weights:  # MXFP4: blocks [E, rows, K / 32, 16] of [E, 2I, H] and [E, H, I]
            for name, (blocks, scales) in (
                ("gate_up", [gate_first(t, 1) for t in mxfp4_pair(weights, prefix, (E, 2 * I, H), source)]),
                ("down", mxfp4_pair(weights, f"{experts}.down_proj", (E, H, I), source)),
            ):
                weights[f"{experts}.{name}_blocks"], weights[f"{experts}.{name}_scales"] = blocks, scales
        else:  # transformers' [E, H, 2I] and [E, I, H]
            stored = ((prefix, (E, H, 2 * I)), (f"{experts}.down_proj", (E, I, H)))
            gate_up, down = (take(weights, n, shape, source).transpose(1, 2) for n, shape in stored)
            weights[f"{experts}.gate_up_proj"] = gate_first(gate_up, 1).contiguous()
            weights[f"{experts}.down_proj"] = down.contiguous()
        weights[f"{experts}.gate_up_bias"] = gate_first(take(weights, f"{prefix}_bias", (E, 2 * I), source), 1)
        weights[f"{experts}.down_bias"] = take(weights, f"{experts}.down_proj_bias", (E, H), source)
    return weights


FAMILY = TargetFamily(
    "gpt_oss",
    architectures=("GptOssForCausalLM",),
    model_types=("gpt_oss",),
    layer_spec=layer_spec,
    layer_kinds=layer_kinds,
    weights=WeightMapping(convert=expert_layout),
)
