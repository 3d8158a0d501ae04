"""Qwen3.5 and Qwen3.6 (dense and MoE): hybrid targets whose `layer_types` mix Gated DeltaNet layers
(`linear_attention`, `blockspec.layers.gated_deltanet`) with gated full attention (Qwen3's, with a
per-channel output gate made by q_proj, rope on the first quarter of each 256-wide head). The MoE
kind (Qwen3.5-35B-A3B, 122B-A10B) routes as Qwen3-MoE does in every layer and adds a shared expert.

What the checkpoints store differently, brought into our layout at load:
- RMSNorm weights are offsets from one (transformers computes x * (1 + w)): stored + 1, then
  rounded once to the model's dtype (in bf16 one rounding of 1 + w, where transformers keeps it fp32);
  the gated norm inside the linear attention is a plain weight.
- q_proj interleaves each head's query rows and output-gate rows: split into q_proj and o_gate_proj.
- Published checkpoints are `...ForConditionalGeneration`: the text model under
  `model.language_model.`, a vision tower under `model.visual.` (not loaded), and multi-token
  prediction layers under `mtp.` (not loaded)."""

import dataclasses
import re
from pathlib import Path

import torch
from transformers import PretrainedConfig

from blockspec.layers.decoder import LayerKind, LayerSpec
from blockspec.layers.gated_deltanet import LinearAttentionSpec
from blockspec.layers.moe import MoESpec
from blockspec.loading.weights import CheckpointError, WeightMapping
from blockspec.models.hf_config import attention_bias, decoder_spec, layer_types
from blockspec.models.qwen3_moe import rename as qwen3_moe_rename
from blockspec.models.qwen3_moe import stack_experts
from blockspec.models.registry import TargetFamily

OFFSET_NORM = re.compile(r"(.*\.(input_layernorm|post_attention_layernorm|q_norm|k_norm)|model\.norm)\.weight")
NOT_LOADED = ("model.visual.", "mtp.")  # the vision tower, the multi-token prediction layers


def linear_attention_spec(config: PretrainedConfig) -> LinearAttentionSpec:
    return LinearAttentionSpec(
        num_key_heads=config.linear_num_key_heads,
        num_value_heads=config.linear_num_value_heads,
        key_head_dim=config.linear_key_head_dim,
        value_head_dim=config.linear_value_head_dim,
        conv_kernel=config.linear_conv_kernel_dim,
    )


def moe_spec(config: PretrainedConfig, norm_topk_prob: bool) -> MoESpec | None:
    if not getattr(config, "num_experts", 0):
        return None
    return MoESpec(
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.moe_intermediate_size,
        routing="softmax_topk",
        norm_topk_prob=norm_topk_prob,
        shared_expert_intermediate_size=getattr(config, "shared_expert_intermediate_size", 0) or 0,
    )


def layer_spec(config: PretrainedConfig, norm_topk_prob: bool = True) -> LayerSpec:
    """Qwen3.5's router renormalizes its top k always (transformers reads no `norm_topk_prob`)."""
    bias = attention_bias(config)
    return dataclasses.replace(
        decoder_spec(config, qkv_bias=bias, o_bias=bias, qk_norm=True),
        attn_output_gate=True,
        linear_attention=linear_attention_spec(config),
        moe=moe_spec(config, norm_topk_prob),
    )


def layer_kinds(config: PretrainedConfig, sparse: list[bool] | None = None) -> list[LayerKind]:
    """Each layer's mixer (`layer_types`) and MLP: sparse where `sparse` says (None: every MLP where
    the config has experts, as transformers' Qwen3.5-MoE builds them whatever `mlp_only_layers` says)."""
    if sparse is None:
        sparse = [bool(getattr(config, "num_experts", 0))] * config.num_hidden_layers
    return [LayerKind(t, "sparse_moe" if s else "dense") for t, s in zip(layer_types(config), sparse, strict=True)]


def rename(name: str) -> str | None:
    if name.startswith(NOT_LOADED):
        return None
    return qwen3_moe_rename(name.replace("model.language_model.", "model.", 1))


def add_norm_offsets(weights: dict[str, torch.Tensor]) -> None:
    """Each offset norm's weight as the scale it stands for, 1 + stored, in fp32 (rounded once at fill)."""
    for name in [n for n in weights if OFFSET_NORM.fullmatch(n)]:
        weights[name] = weights[name].float() + 1


def ungroup(w: torch.Tensor, groups: int, parts: list[int]) -> list[torch.Tensor]:
    """Rows laid out per group as `parts` -> each part's rows of every group, in group order."""
    return [p.reshape(-1, *w.shape[1:]) for p in w.view(groups, sum(parts), *w.shape[1:]).split(parts, dim=1)]


def split_output_gate(weights: dict[str, torch.Tensor], spec: LayerSpec, source: Path) -> None:
    """Each `self_attn.q_proj` (per head: head_dim query rows, then head_dim gate rows) -> q_proj
    and o_gate_proj (each per head in order)."""
    heads, d = spec.num_heads, spec.head_dim
    for name in [n for n in weights if re.fullmatch(r".*\.self_attn\.q_proj\.(weight|bias)", n)]:
        w = weights.pop(name)
        if w.shape[0] != 2 * heads * d:
            raise CheckpointError(
                f"{source}: {name} has {w.shape[0]} rows, expected {2 * heads * d} (each head's query and output-gate rows)"
            )
        weights[name], weights[name.replace(".q_proj.", ".o_gate_proj.")] = ungroup(w, heads, [d, d])


def convert(weights: dict[str, torch.Tensor], spec: LayerSpec, source: Path) -> dict[str, torch.Tensor]:
    add_norm_offsets(weights)
    split_output_gate(weights, spec, source)
    return stack_experts(weights, spec, source)


WEIGHTS = WeightMapping(rename=rename, convert=convert)

QWEN3_5 = TargetFamily(
    "qwen3_5",
    architectures=("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
    model_types=("qwen3_5", "qwen3_5_text"),
    layer_spec=layer_spec,
    layer_kinds=layer_kinds,
    weights=WEIGHTS,
)

QWEN3_5_MOE = TargetFamily(
    "qwen3_5_moe",
    architectures=("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
    model_types=("qwen3_5_moe", "qwen3_5_moe_text"),
    layer_spec=layer_spec,
    layer_kinds=layer_kinds,
    weights=WEIGHTS,
)
