"""The model registry: every registered architecture resolves to its record, others are refused
naming the supported ones, families declare their layers' kinds, and loading makes the derived
weights it is asked for without changing what the model computes."""

import pytest
import torch
from conftest import make_drafter, make_target
from safetensors.torch import load_file, save_file
from test_target_logits import paged_logits
from transformers import PretrainedConfig, Qwen2Config

from blockspec.layers.decoder import PAGED_KV, LayerKind
from blockspec.layers.quantization import Fp8Linear
from blockspec.loading.drafters import load_drafter
from blockspec.loading.finish import LoadOptions
from blockspec.loading.hf import load_target
from blockspec.models.dflash import DFlashDrafter
from blockspec.models.registry import drafter_kind_for, drafter_kinds, family_for, target_families

CPU = torch.device("cpu")


def test_every_registered_architecture_resolves():
    families = {f.name: f for f in target_families()}
    assert set(families) >= {"llama", "qwen2", "qwen3"}
    for family in families.values():
        for arch in family.architectures:
            assert family_for(PretrainedConfig(architectures=[arch])) is family
        for model_type in family.model_types:  # a config.json that names no architecture
            config = PretrainedConfig()
            config.model_type = model_type
            assert family_for(config) is family
    kinds = {k.name: k for k in drafter_kinds()}
    assert drafter_kind_for(PretrainedConfig(architectures=["DFlashDraftModel"])) is kinds["dflash"]
    assert kinds["dflash"].model is DFlashDrafter and kinds["dflash"].proposer == "dflash"


def test_unknown_architectures_name_the_supported_ones():
    with pytest.raises(
        ValueError, match=r"architecture GPT2LMHeadModel is not supported \(supported: .*Qwen3ForCausalLM"
    ):
        family_for(PretrainedConfig(architectures=["GPT2LMHeadModel"]))
    config = PretrainedConfig()
    config.model_type = "gpt2"
    with pytest.raises(
        ValueError,
        match=r"model_type 'gpt2' is not supported \(supported: gpt_oss, llama, qwen2, qwen3, qwen3_5, qwen3_5_moe, qwen3_5_moe_text, qwen3_5_text, qwen3_moe, qwen3_next",
    ):
        family_for(config)
    with pytest.raises(ValueError, match=r"architecture Qwen3ForCausalLM is not a supported drafter \(supported: DFl"):
        drafter_kind_for(PretrainedConfig(architectures=["Qwen3ForCausalLM"]))


def test_layer_kinds_of_a_sliding_window_qwen2():
    """Qwen2 slides from max_window_layers on; every attention layer keeps paged K/V."""
    config = Qwen2Config(
        architectures=["Qwen2ForCausalLM"], vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True, sliding_window=16, max_window_layers=1,
    )  # fmt: skip
    family = family_for(config)
    expected = [LayerKind("full_attention")] + [LayerKind("sliding_attention")] * 3
    assert family.layer_kinds(config) == expected and family.cache_kinds(config) == (PAGED_KV,)
    assert family.problems(config) == []
    model = family.build(config)
    assert model.sliding_window == 16 and model.layer_kinds == expected
    assert [layer.self_attn.layer_type for layer in model.layers] == [k.attention for k in expected]
    assert family.layer_spec(config).qkv_bias and not family.layer_spec(config).o_bias
    config.layer_types = ["linear_attention"] * 4  # a Gated DeltaNet hybrid's layers: not Qwen2's
    assert family.problems(config) == ["qwen2 has no linear-attention layers: its layer_types name them"]
    config.layer_types = ["mamba"] * 4
    assert family.problems(config) == [
        "layer_types ['mamba'] are not supported (supported: full_attention, sliding_attention, linear_attention)"
    ]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_folding_norms_at_load_keeps_the_logits(tmp_path, family):
    """load_target with fold_norms moves every layer's norm weights (far from 1 here) into q|k|v and
    gate|up: the same logits as the model loaded without (fp32)."""
    path = make_target(tmp_path / "t", family, attention_bias=True)
    weights = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(3)
    for name in [n for n in weights if n.endswith("layernorm.weight")]:
        weights[name] = torch.rand(weights[name].shape, generator=gen) * 2 + 0.2
    save_file(weights, path / "model.safetensors")
    plain = load_target(path, torch.float32, CPU).model
    folded = load_target(path, torch.float32, CPU, LoadOptions(fold_norms=True)).model
    assert folded.norms_folded and not plain.norms_folded
    assert all(layer.input_layernorm.weight is None is layer.post_attention_layernorm.weight for layer in folded.layers)
    ids = torch.randint(0, 128, (30,), generator=gen).tolist()
    torch.testing.assert_close(paged_logits(folded, ids, split=10), paged_logits(plain, ids, split=10))


def test_fp8_copies_are_made_at_load(tmp_path):
    """load_drafter with fp8 makes the drafter's FP8 copies (and with fp8_lm_head one of the
    target's LM head, which keeps its own) and records it; without, none are made."""
    t = make_target(tmp_path / "t", "qwen3")
    d = make_drafter(tmp_path / "d", t)
    target = load_target(t, torch.float32, CPU).model
    head = target.lm_head.weight.clone()
    plain = load_drafter(d, target, torch.float32, CPU)
    assert not plain.fp8 and plain.fused_kv_fp8 is None and plain.lm_head_fp8 is None
    drafter = load_drafter(d, target, torch.float32, CPU, LoadOptions(fp8=True, fp8_lm_head=True))
    assert drafter.fp8 and isinstance(drafter.fused_kv_fp8, Fp8Linear) and isinstance(drafter.lm_head_fp8, Fp8Linear)
    assert isinstance(drafter.layers[0].mlp.gate_up_proj, Fp8Linear) and isinstance(drafter.fc, Fp8Linear)
    assert type(target.lm_head) is not Fp8Linear and torch.equal(target.lm_head.weight, head)
