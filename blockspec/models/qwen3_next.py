"""Qwen3-Next (Qwen3-Next-80B-A3B, Qwen3-Coder-Next): the Qwen3.5-MoE model (`blockspec.models.qwen3_5`)
with Qwen3-MoE's `decoder_sparse_step`/`mlp_only_layers` and `norm_topk_prob`, in an older checkpoint
layout: the linear attention's projections interleave their parts per key-head group, `in_proj_qkvz`
(each group's q, k, its value heads' v, then their z) and `in_proj_ba` (each group's b, then a).
Loading splits them into Qwen3.5's in_proj_qkv (all q | all k | all v), in_proj_z, in_proj_b and
in_proj_a."""

from pathlib import Path

import torch
from transformers import PretrainedConfig

from blockspec.layers.decoder import LayerKind, LayerSpec
from blockspec.loading.weights import CheckpointError, WeightMapping
from blockspec.models.qwen3_5 import convert as qwen3_5_convert
from blockspec.models.qwen3_5 import layer_kinds as qwen3_5_kinds
from blockspec.models.qwen3_5 import layer_spec as qwen3_5_spec
from blockspec.models.qwen3_5 import rename, ungroup
from blockspec.models.qwen3_moe import is_sparse
from blockspec.models.registry import TargetFamily


def split_grouped(weights: dict[str, torch.Tensor], spec: LayerSpec, source: Path) -> None:
    la = spec.linear_attention
    per_group = la.num_value_heads // la.num_key_heads
    v = per_group * la.value_head_dim
    layouts = {
        "in_proj_qkvz": ([la.key_head_dim, la.key_head_dim, v, v], ("q", "k", "v", "z")),
        "in_proj_ba": ([per_group, per_group], ("b", "a")),
    }
    for stored, (parts, names) in layouts.items():
        for name in [n for n in weights if f".linear_attn.{stored}." in n]:
            w = weights.pop(name)
            if w.shape[0] != la.num_key_heads * sum(parts):
                raise CheckpointError(
                    f"{source}: {name} has {w.shape[0]} rows, expected {la.num_key_heads * sum(parts)}"
                )
            split = dict(zip(names, ungroup(w, la.num_key_heads, parts)))
            if stored == "in_proj_qkvz":
                weights[name.replace(stored, "in_proj_qkv")] = torch.cat([split["q"], split["k"], split["v"]])
                weights[name.replace(stored, "in_proj_z")] = split["z"]
            else:
                weights[name.replace(stored, "in_proj_b")], weights[name.replace(stored, "in_proj_a")] = (
                    split["b"],
                    split["a"],
                )


def layer_spec(config: PretrainedConfig) -> LayerSpec:
    return qwen3_5_spec(config, norm_topk_prob=bool(config.norm_topk_prob))


def layer_kinds(config: PretrainedConfig) -> list[LayerKind]:
    """Sparse MLPs where Qwen3-MoE places them (`decoder_sparse_step`, `mlp_only_layers`)."""
    return qwen3_5_kinds(config, [is_sparse(config, i) for i in range(config.num_hidden_layers)])


def convert(weights: dict[str, torch.Tensor], spec: LayerSpec, source: Path) -> dict[str, torch.Tensor]:
    split_grouped(weights, spec, source)
    return qwen3_5_convert(weights, spec, source)


FAMILY = TargetFamily(
    "qwen3_next",
    architectures=("Qwen3NextForCausalLM",),
    model_types=("qwen3_next",),
    layer_spec=layer_spec,
    layer_kinds=layer_kinds,
    weights=WeightMapping(rename=rename, convert=convert),
)
