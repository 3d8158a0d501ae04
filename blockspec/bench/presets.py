"""Models with random weights at real geometry, for timing without any download:
`random:Qwen3-8B`, `random:Qwen3-8B-DFlash-b16`, `random:Qwen3-8B-DSpark-b7`, `random:Qwen3-8B-DFlash2-b8`,
`random:Llama-3.1-8B`; the embedded default pair's geometry `random:SmolLM2-135M` with
`random:SmolLM2-135M-DFlash` and `random:SmolLM2-135M-DSpark`; MoE targets `random:Qwen3-Coder-30B-A3B` and `random:gpt-oss-20b` with their
drafters `random:Qwen3-Coder-30B-A3B-DFlash` and `random:gpt-oss-20b-DFlash`; hybrid (Gated DeltaNet)
targets `random:Qwen3.5-27B` and `random:Qwen3.6-35B-A3B` with `random:Qwen3.5-27B-DFlash` and
`random:Qwen3.6-35B-A3B-DFlash`;
and small presets (`random:small`, `random:small-moe`, `random:small-hybrid`, `random:small-DFlash`,
`random:small-DSpark`)
that run on a CPU."""

import torch
from transformers import GptOssConfig, LlamaConfig, Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3Config, Qwen3MoeConfig

from blockspec.layers.moe import Experts
from blockspec.layers.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from blockspec.loading.finish import AS_STORED, LoadOptions, finish_drafter, finish_target, stores_mxfp4
from blockspec.loading.hf import Target
from blockspec.models.causal_lm import CausalLM
from blockspec.models.dflash import ARCHITECTURE
from blockspec.models.dflash2 import ARCHITECTURE as DFLASH2_ARCHITECTURE
from blockspec.models.dspark import ARCHITECTURES as DSPARK_ARCHITECTURES
from blockspec.models.registry import Drafter, drafter_kind_for, family_for

# What Qwen3.5 / Qwen3.6 text configs share (their published config.json files)
HYBRID_FIELDS = {
    "vocab_size": 248320,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 262144,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
# The small presets' widths (CPU-sized), targets' and drafters' alike
SMALL_WIDTHS = {
    "vocab_size": 8192,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 4096,
}
TARGETS = {
    "Qwen3-8B": lambda: Qwen3Config(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        architectures=["Qwen3ForCausalLM"],
    ),
    "Llama-3.1-8B": lambda: LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        architectures=["LlamaForCausalLM"],
    ),
    # Qwen/Qwen3-Coder-30B-A3B-Instruct's config.json
    "Qwen3-Coder-30B-A3B": lambda: Qwen3MoeConfig(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=5472,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=262144,
        rope_theta=10000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        architectures=["Qwen3MoeForCausalLM"],
    ),
    # openai/gpt-oss-20b's config.json: its experts MXFP4 (random ones, rounded to MXFP4 values)
    "gpt-oss-20b": lambda: GptOssConfig(
        vocab_size=201088,
        hidden_size=2880,
        intermediate_size=2880,
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        num_local_experts=32,
        num_experts_per_tok=4,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 12,
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 4096,
            "truncate": False,
        },
        swiglu_limit=7.0,
        quantization_config={"quant_method": "mxfp4"},
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        architectures=["GptOssForCausalLM"],
    ),
    # Qwen/Qwen3.5-27B's text_config (tests/fixtures/targets/SOURCES.md): 48 Gated DeltaNet layers, 16 gated
    # full-attention ones (every 4th), a dense MLP
    "Qwen3.5-27B": lambda: Qwen3_5TextConfig(
        **HYBRID_FIELDS,
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=64,
        num_attention_heads=24,
        num_key_value_heads=4,
        linear_num_value_heads=48,
        architectures=["Qwen3_5ForCausalLM"],
    ),
    # Qwen/Qwen3.6-35B-A3B's text_config: 30 Gated DeltaNet layers, 10 gated full-attention ones, every MLP
    # 256 experts (top 8) and a shared expert
    "Qwen3.6-35B-A3B": lambda: Qwen3_5MoeTextConfig(
        **HYBRID_FIELDS,
        hidden_size=2048,
        num_hidden_layers=40,
        num_attention_heads=16,
        num_key_value_heads=2,
        linear_num_value_heads=32,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        architectures=["Qwen3_5MoeForCausalLM"],
    ),
    "small-moe": lambda: Qwen3MoeConfig(
        **SMALL_WIDTHS,
        moe_intermediate_size=128,
        num_hidden_layers=4,
        num_experts=16,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        tie_word_embeddings=True,
        architectures=["Qwen3MoeForCausalLM"],
    ),
    # the hybrid layers at the small preset's widths: 6 Gated DeltaNet layers, 2 gated full-attention ones
    "small-hybrid": lambda: Qwen3_5TextConfig(
        **SMALL_WIDTHS,
        num_hidden_layers=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        tie_word_embeddings=True,
        architectures=["Qwen3_5ForCausalLM"],
    ),
    # the embedded default target's geometry (SmolLM2-135M-Instruct)
    "SmolLM2-135M": lambda: LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        architectures=["LlamaForCausalLM"],
    ),
    "small": lambda: Qwen3Config(
        **SMALL_WIDTHS, num_hidden_layers=8, tie_word_embeddings=True, architectures=["Qwen3ForCausalLM"]
    ),
}
# DeepSpec's released DSpark drafters' fields (`dspark_qwen3_*_block7`): 7 shifted rows, a vanilla
# Markov head of rank 256 and a confidence head that reads its embedding.
DSPARK_FIELDS = {
    "architectures": [DSPARK_ARCHITECTURES[0]],
    "block_size": 7,
    "markov_rank": 256,
    "markov_head_type": "vanilla",
    "enable_confidence_head": True,
    "confidence_head_with_markov": True,
}
# A drafter's geometry: Qwen3-8B's layers (5 of them), and the small target's (2).
QWEN3_8B_LAYERS = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 5,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
}
SMALL_LAYERS = SMALL_WIDTHS | {"num_hidden_layers": 2}
# the shipped default drafter's geometry (blockspec/assets/SmolLM2-135M-Instruct-DFlash)
SMOLLM2_LAYERS = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 4,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
    "block_size": 16,
}
SMOLLM2_IDS = {"mask_token_id": 16, "target_layer_ids": [1, 10, 18, 27]}
QWEN3_8B_IDS = {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}
# z-lab's released DFlash2 drafters' fields (Qwen3.8-27B-DFlash2): 2-tap convolutions over groups of
# 16 channels, a selector of rank 256 over 16 candidates, bidirectional sliding layers of 2048.
DFLASH2_FIELDS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}
DFLASH2_LAYERS = {
    "architectures": [DFLASH2_ARCHITECTURE],
    "layer_types": ["sliding_attention"] * 5,
    "use_sliding_window": True,
    "sliding_window": 2048,
    "is_causal": False,
}
# z-lab's drafters for the MoE targets (tests/fixtures/drafters/SOURCES.md: their geometry is quoted
# from the published configs; the Coder drafter's mask token is a guess, Qwen3's <|MASK|> slot)
MOE_DRAFTER_LAYERS = {"num_hidden_layers": 8, "architectures": [ARCHITECTURE]}
HYBRID_DRAFTER_FIELDS = {
    "architectures": [ARCHITECTURE],
    "vocab_size": 248320,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 262144,
    "rope_theta": 10000000.0,
    "use_sliding_window": True,
}
DRAFTERS = {
    "Qwen3-Coder-30B-A3B-DFlash": lambda: Qwen3Config(
        **MOE_DRAFTER_LAYERS,
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        max_position_embeddings=262144,
        rope_theta=10000000.0,
        block_size=16,
        dflash_config={"mask_token_id": 151669, "target_layer_ids": [1, 12, 23, 34, 45]},
    ),
    "gpt-oss-20b-DFlash": lambda: Qwen3Config(
        **MOE_DRAFTER_LAYERS,
        vocab_size=201088,
        hidden_size=2880,
        intermediate_size=7680,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        attention_bias=True,
        max_position_embeddings=131072,
        rope_parameters=TARGETS["gpt-oss-20b"]().rope_parameters,
        block_size=8,
        dflash_config={"mask_token_id": 200000, "target_layer_ids": [1, 6, 11, 16, 21]},
    ),
    # z-lab's Qwen3.6-27B-DFlash (tests/fixtures/drafters/SOURCES.md): 4 sliding layers of 2048, then a full
    # one; Qwen3.5-27B-DFlash has the same widths and taps (its layer types are not confirmed)
    "Qwen3.5-27B-DFlash": lambda: Qwen3Config(
        **HYBRID_DRAFTER_FIELDS,
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=5,
        layer_types=["sliding_attention"] * 4 + ["full_attention"],
        sliding_window=2048,
        block_size=16,
        dflash_config={"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]},
    ),
    # z-lab's Qwen3.6-35B-A3B-DFlash: 5 sliding layers of 4096, then a full one, 8 taps
    "Qwen3.6-35B-A3B-DFlash": lambda: Qwen3Config(
        **HYBRID_DRAFTER_FIELDS,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=6,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        sliding_window=4096,
        dflash_config={"block_size": 16, "mask_token_id": 248077, "target_layer_ids": [1, 6, 11, 16, 22, 27, 32, 37]},
    ),
    "Qwen3-8B-DFlash-b16": lambda: Qwen3Config(
        **QWEN3_8B_LAYERS, block_size=16, dflash_config=QWEN3_8B_IDS, architectures=[ARCHITECTURE]
    ),
    "Qwen3-8B-DSpark-b7": lambda: Qwen3Config(**QWEN3_8B_LAYERS, **DSPARK_FIELDS, **QWEN3_8B_IDS),
    "Qwen3-8B-DFlash2-b8": lambda: Qwen3Config(
        **QWEN3_8B_LAYERS, **DFLASH2_LAYERS, block_size=8, dflash_config=QWEN3_8B_IDS | DFLASH2_FIELDS
    ),
    # the same drafter without its convolutions and selector: DFlash2's cost over DFlash's
    "Qwen3-8B-DFlash2-b8-plain": lambda: Qwen3Config(
        **QWEN3_8B_LAYERS, **DFLASH2_LAYERS, block_size=8, dflash_config=QWEN3_8B_IDS
    ),
    "SmolLM2-135M-DFlash": lambda: Qwen3Config(
        **SMOLLM2_LAYERS, dflash_config=SMOLLM2_IDS, architectures=[ARCHITECTURE]
    ),
    # a DSpark drafter made from it (`blockspec train --method dspark --rows filled --init ...
    # --markov-rank 32`): z-lab's filled rows, a rank-32 Markov head and a confidence head
    "SmolLM2-135M-DSpark": lambda: Qwen3Config(
        **SMOLLM2_LAYERS
        | SMOLLM2_IDS
        | DSPARK_FIELDS
        | {"block_size": 16, "markov_rank": 32, "sample_from_anchor": False}
    ),
    "small-DSpark": lambda: Qwen3Config(**SMALL_LAYERS, **DSPARK_FIELDS, mask_token_id=8191),
    "small-DFlash": lambda: Qwen3Config(
        **SMALL_LAYERS, block_size=16, dflash_config={"mask_token_id": 8191}, architectures=[ARCHITECTURE]
    ),
}


def is_preset(name: str | None) -> bool:
    return name is not None and name.startswith("random:")


def build_random(build, *args, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """build(*args) in `dtype` on `device`, its weights as the modules initialize them."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            module = build(*args)
        return module.to(device)  # buffers made on the CPU (rope tables) follow
    finally:
        torch.set_default_dtype(previous)


def preset(table: dict, name: str):
    key = name.removeprefix("random:")
    if key not in table:
        raise ValueError(f"unknown preset {name!r} (choose from {', '.join('random:' + k for k in table)})")
    return table[key]()


def random_target(name: str, dtype: torch.dtype, device: torch.device, options: LoadOptions = AS_STORED) -> Target:
    """A target preset, ready as `load_target` leaves a checkpoint's (`finish_target`)."""
    torch.manual_seed(0)
    config = preset(TARGETS, name)
    model = build_random(family_for(config).build, config, dtype=dtype, device=device)
    if stores_mxfp4(config):
        as_mxfp4_values(model)
    return Target(finish_target(model, options), None, [], name)


@torch.no_grad()
def as_mxfp4_values(model: CausalLM) -> None:
    """Each expert weight rounded to MXFP4 values, as an MXFP4 checkpoint's load: kept in MXFP4
    (`LoadOptions.mxfp4_experts`) or not, the model is the same."""
    for experts in [m for m in model.modules() if isinstance(m, Experts)]:
        for weight in experts.weights():
            for expert in weight:
                expert.copy_(dequantize_mxfp4(*quantize_mxfp4(expert), expert.dtype))


def random_drafter(
    name: str, target: CausalLM, dtype: torch.dtype, device: torch.device, options: LoadOptions = AS_STORED
) -> Drafter:
    """A drafter preset for `target`, ready as `load_drafter` leaves a checkpoint's (`finish_drafter`)."""
    torch.manual_seed(1)
    config = preset(DRAFTERS, name)
    drafter = build_random(drafter_kind_for(config).build, config, target, dtype=dtype, device=device)
    return finish_drafter(drafter, target, options)
