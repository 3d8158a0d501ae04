"""Bad input gets a specific error: broken checkpoints, mismatched drafters, bad prompts,
impossible sampling parameters."""

import json
import shutil
import sys

import numpy as np
import pytest
import torch
from conftest import make_drafter, make_target
from safetensors.torch import load_file, save_file

import blockspec.llm as llm_module
from blockspec import LLM, SamplingParams
from blockspec.cli import main as cli_main
from blockspec.config import EngineConfig
from blockspec.engine.engine import LLMEngine
from blockspec.llm import resolve_dtype
from blockspec.loading.hf import load_target
from blockspec.loading.weights import CheckpointError


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("errors")
    t = make_target(root / "t", "qwen3", vocab=128)
    return t, make_drafter(root / "d", t, target_layer_ids=[1, 3])


def copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_directory_and_files(tmp_path, pair):
    t, _ = pair
    with pytest.raises(CheckpointError, match="no such model directory"):
        LLM(str(tmp_path / "nope"), None, device="cpu")
    broken = copy(t, tmp_path / "noconfig")
    (broken / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json is missing"):
        LLM(str(broken), None, device="cpu")
    broken = copy(t, tmp_path / "noweights")
    (broken / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors weights found$"):
        LLM(str(broken), None, device="cpu")
    (broken / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(CheckpointError, match="pytorch_model.bin: pickled weights are not loaded, safetensors only"):
        LLM(str(broken), None, device="cpu")


def test_corrupt_weights_and_config(tmp_path, pair):
    t, _ = pair
    broken = copy(t, tmp_path / "corrupt")
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage")
    with pytest.raises(CheckpointError, match="not a valid safetensors file"):
        LLM(str(broken), None, device="cpu")
    pointer = b"version https://git-lfs.github.com/spec/v1\noid sha256:0123\nsize 4096\n"
    (broken / "model.safetensors").write_bytes(pointer)
    with pytest.raises(CheckpointError, match="model.safetensors: a Git LFS pointer, not the weights"):
        LLM(str(broken), None, device="cpu")
    broken = copy(t, tmp_path / "badjson")
    (broken / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json"):
        LLM(str(broken), None, device="cpu")


def test_missing_and_misshapen_tensors(tmp_path, pair):
    t, _ = pair
    weights = load_file(t / "model.safetensors")
    broken = copy(t, tmp_path / "missing")
    save_file({k: v for k, v in weights.items() if "layers.1.mlp.up_proj" not in k}, broken / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.up_proj.weight"):
        LLM(str(broken), None, device="cpu")
    # a projection that loading packs with others is named as the checkpoint holds it, its first part too
    broken = copy(t, tmp_path / "first_part")
    save_file({k: v for k, v in weights.items() if "layers.1.self_attn.q_proj" not in k}, broken / "model.safetensors")
    with pytest.raises(
        CheckpointError, match=r"missing from the checkpoint: \['model.layers.1.self_attn.q_proj.weight'\]"
    ):
        LLM(str(broken), None, device="cpu")
    deeper = rewrite(t, tmp_path / "deeper", {"num_hidden_layers": 5, "layer_types": None})  # a layer it lacks
    with pytest.raises(
        CheckpointError, match=r"model.layers.4.self_attn.q_proj.weight', 'model.layers.4.self_attn.k_proj"
    ):
        LLM(str(deeper), None, device="cpu")
    broken = copy(t, tmp_path / "shape")
    weights["model.norm.weight"] = torch.ones(63)
    save_file(weights, broken / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model.norm.weight has shape \(63,\), expected \(64,\)"):
        LLM(str(broken), None, device="cpu")


def test_unsupported_architecture_and_rope(tmp_path, pair):
    t, _ = pair
    broken = copy(t, tmp_path / "arch")
    cfg = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(CheckpointError, match="GPT2LMHeadModel is not supported"):
        LLM(str(broken), None, device="cpu")
    (broken / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "architectures"}))
    assert LLM(str(broken), None, device="cpu").generate([[5, 6]])[0].outputs[0].token_ids  # by model_type, as HF
    broken = copy(t, tmp_path / "rope")
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    (broken / "config.json").write_text(json.dumps({**cfg, "rope_parameters": rope}))
    with pytest.raises(ValueError, match="rope type 'dynamic' is not supported"):
        LLM(str(broken), None, device="cpu")


def test_mismatched_drafters(tmp_path, pair):
    t, d = pair
    other = make_target(tmp_path / "other", "qwen3", vocab=128, layers=2)
    with pytest.raises(CheckpointError, match="trained for a target of 4 layers, this target has 2"):
        LLM(str(other), {"model": str(d)}, device="cpu")
    unsaid = copy(d, tmp_path / "no_num_target_layers")
    cfg = json.loads((unsaid / "config.json").read_text())
    (unsaid / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "num_target_layers"}))
    with pytest.raises(CheckpointError, match=r"target_layer_ids .* must be in -1..1 \(-1: the embedding output\)"):
        LLM(str(other), {"model": str(unsaid)}, device="cpu")
    vocabless = rewrite(d, tmp_path / "no_vocab_size", {"vocab_size": None})  # it drafts over the target's
    assert LLM(str(t), {"model": str(vocabless)}, device="cpu").generate([[5, 6]])[0].outputs[0].token_ids
    three = copy(d, tmp_path / "three_ids")
    cfg = json.loads((three / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [0, 1, 2]
    (three / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="fc.weight takes 128 inputs but 3 target layers x hidden 64 = 192"):
        LLM(str(t), {"model": str(three)}, device="cpu")
    narrow = make_target(tmp_path / "narrow", "qwen3", vocab=128, hidden=32)
    with pytest.raises(CheckpointError, match="drafter hidden_size 64 != target hidden_size 32"):
        LLM(str(narrow), {"model": str(d)}, device="cpu")
    small_vocab = make_target(tmp_path / "sv", "qwen3", vocab=64)
    with pytest.raises(CheckpointError, match="mask_token_id 127 is outside the target vocabulary"):
        LLM(str(small_vocab), {"model": str(d)}, device="cpu")
    with pytest.raises(
        CheckpointError,
        match=r"architecture Qwen3ForCausalLM is not a supported drafter \(supported: DFlash2DraftModel, DFlashDraftModel, DSparkDraftModel",
    ):
        LLM(str(t), {"model": str(t)}, device="cpu")
    unnamed = copy(d, tmp_path / "unnamed")
    cfg = json.loads((unnamed / "config.json").read_text())
    (unnamed / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "architectures"}))
    with pytest.raises(CheckpointError, match="config.json names no architecture, so it is not a supported drafter"):
        LLM(str(t), {"model": str(unnamed)}, device="cpu")
    (unnamed / "config.json").write_text(json.dumps({**cfg, "architectures": "DFlashDraftModel"}))
    with pytest.raises(CheckpointError, match="architectures must be a list of class names, got 'DFlashDraftModel'"):
        LLM(str(t), {"model": str(unnamed)}, device="cpu")
    with pytest.raises(ValueError, match="speculative method 'eagle' is not supported"):
        LLM(str(t), {"method": "eagle", "model": str(d)}, device="cpu")


def rewrite(src, dst, config=None, weights=None):
    """A copy of checkpoint `src` with its config.json updated by `config` (None values delete
    keys) and its single safetensors file replaced by `weights`."""
    copy(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key, value in (config or {}).items():
        cfg.pop(key) if value is None else cfg.__setitem__(key, value)
    (dst / "config.json").write_text(json.dumps(cfg))
    if weights is not None:
        save_file(weights, dst / "model.safetensors")
    return dst


def test_unsupported_weights_and_configs(tmp_path, pair):
    t, _ = pair
    weights = load_file(t / "model.safetensors")
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        LLM(str(rewrite(t, tmp_path / "gelu", {"hidden_act": "gelu"})), None, device="cpu")
    for dtype, name in ((torch.int64, "int64"), (torch.float8_e4m3fn, "float8_e4m3fn")):
        bad = {**weights, "model.norm.weight": weights["model.norm.weight"].to(dtype)}
        with pytest.raises(CheckpointError, match=f"model.norm.weight is {name}: 16/32/64-bit float weights"):
            LLM(str(rewrite(t, tmp_path / name, weights=bad)), None, device="cpu")
    # q_proj 16 rows too many, k_proj 16 too few: the packed q|k|v has the right size
    q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    moved = torch.cat([weights[q], weights[k]])
    bad = {**weights, q: moved[:80], k: moved[80:]}
    with pytest.raises(CheckpointError, match=r"q_proj.weight has shape \(80, 64\), expected 64 rows"):
        LLM(str(rewrite(t, tmp_path / "split", weights=bad)), None, device="cpu")
    with pytest.raises(ValueError, match="num_attention_heads 4 is not a multiple of num_key_value_heads 3"):
        LLM(str(rewrite(t, tmp_path / "heads", {"num_key_value_heads": 3})), None, device="cpu")
    for field, value in (("hidden_size", -64), ("num_key_value_heads", 0), ("head_dim", 0)):
        with pytest.raises(CheckpointError, match=rf"{field} must be a positive integer, got {value}"):
            LLM(str(rewrite(t, tmp_path / f"size_{field}", {field: value})), None, device="cpu")
    for method in ("fp8", "gptq"):
        quantized = rewrite(t, tmp_path / method, {"quantization_config": {"quant_method": method}})
        with pytest.raises(CheckpointError, match=f"quant_method '{method}' is not supported"):
            LLM(str(quantized), None, device="cpu")
    with pytest.raises(CheckpointError, match="config.json: not a usable model config"):
        LLM(str(rewrite(t, tmp_path / "nolayers", {"num_hidden_layers": "four"})), None, device="cpu")
    with pytest.raises(CheckpointError, match="config.json: fields missing: hidden_size, vocab_size"):
        LLM(str(rewrite(t, tmp_path / "nowidth", {"hidden_size": None, "vocab_size": None})), None, device="cpu")
    vocabless = copy(t, tmp_path / "vocabless")  # a download that left the vocabulary out
    (vocabless / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    with pytest.raises(CheckpointError, match="the tokenizer has no tokens but its special ones"):
        LLM(str(vocabless), None, device="cpu")
    broken = copy(t, tmp_path / "tokenizer")
    (broken / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="the tokenizer files do not load"):
        LLM(str(broken), None, device="cpu")


@pytest.mark.parametrize(
    "family, name",
    [
        ("qwen3", "model.layers.0.self_attn.k_proj.weight"),  # a part of the packed q|k|v
        ("qwen3", "model.layers.1.mlp.up_proj.weight"),  # of gate|up
        ("qwen3_moe", "model.layers.0.mlp.experts.3.up_proj.weight"),  # an expert stacked with the others
        ("qwen3_5", "model.layers.0.input_layernorm.weight"),  # a norm stored as its offset from 1
    ],
)
@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_tensors_of_other_dtypes_are_refused_before_they_are_combined(tmp_path, family, name, dtype):
    """A tensor that loading concatenates, stacks or offsets is checked before: those ops would
    convert an integer or bool tensor to float silently."""
    t = make_target(tmp_path / "t", family, layers=2, vocab=64)
    weights = load_file(t / "model.safetensors")
    weights[name] = (weights[name] * 100).to(dtype)
    dtype_name = str(dtype).removeprefix("torch.")
    with pytest.raises(CheckpointError, match=f"{name} is {dtype_name}: 16/32/64-bit float weights expected"):
        LLM(str(rewrite(t, tmp_path / "bad", weights=weights)), None, device="cpu")


def test_malformed_shard_index(tmp_path, pair):
    t, _ = pair
    weights = load_file(t / "model.safetensors")
    root = copy(t, tmp_path / "sharded")
    (root / "model.safetensors").unlink()
    names = sorted(weights)
    save_file({n: weights[n] for n in names[:5]}, root / "a.safetensors")
    save_file({n: weights[n] for n in names[4:]}, root / "b.safetensors")  # names[4] in both
    index = root / "model.safetensors.index.json"
    for bad in ([], {"weight_map": None}, {"weight_map": {"x": 3}}):
        index.write_text(json.dumps(bad))
        with pytest.raises(CheckpointError, match="expected a 'weight_map' of tensor name -> file name"):
            LLM(str(root), None, device="cpu")
    index.write_text(
        json.dumps({"weight_map": {n: "a.safetensors" if i < 5 else "b.safetensors" for i, n in enumerate(names)}})
    )
    with pytest.raises(CheckpointError, match=f"{names[4]} is in both a.safetensors and b.safetensors"):
        LLM(str(root), None, device="cpu")


@pytest.mark.parametrize(
    "change,message",
    [
        ({"block_size": None}, "block_size is missing"),
        ({"dflash_config": {"mask_token_id": 12.5}}, "mask_token_id must be an integer, got 12.5"),
        (
            {"dflash_config": {"mask_token_id": 1, "target_layer_ids": 1}},
            "target_layer_ids must be a non-empty list of integers",
        ),
        ({"layer_types": ["chunked_attention"] * 2}, r"layer_types \['chunked_attention'\] are not supported"),
        ({"layer_types": ["sliding_attention"] * 2}, "sliding_attention layers need a positive sliding_window"),
        ({"dflash_config": {"mask_token_id": 1, "output_multiplier": "2"}}, "output_multiplier must be a number"),
        ({"num_attention_heads": 3}, "num_attention_heads 3 is not a multiple of num_key_value_heads 2"),
        ({"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer, got 0"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quant_method 'fp8' is not supported"),
    ],
)
def test_malformed_drafter_configs(tmp_path, pair, change, message):
    t, d = pair
    with pytest.raises(CheckpointError, match="drafter config does not fit the target: .*" + message):
        LLM(str(t), {"model": str(rewrite(d, tmp_path / "d", change))}, device="cpu")


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"temperature": float("inf")}, "temperature must be >= 0 and finite"),
        ({"seed": 2**70}, "seed must be a 64-bit int"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -2}, "top_k must be -1, 0 or positive"),
        ({"top_k": True}, "top_k must be -1, 0 or positive"),  # a bool is no count
        ({"seed": True}, "seed must be a 64-bit int"),
        ({"max_tokens": True}, "max_tokens must be >= 1"),
        ({"stop_token_ids": [False]}, "stop_token_ids must be non-negative ints"),
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"min_p": None}, r"min_p must be in \[0, 1\], got None"),
        ({"stop": [""]}, "stop must be at most 64 non-empty strings"),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be non-negative"),
    ],
)
def test_invalid_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"row_invariant": "off"}, "EngineConfig.row_invariant must be bool, got 'off'"),  # it would read as on
        ({"prefix_caching": "no"}, "EngineConfig.prefix_caching must be bool or None, got 'no'"),
        ({"max_num_seqs": "4"}, "EngineConfig.max_num_seqs must be int, got '4'"),
        ({"kernels": {}}, "EngineConfig.kernels must be KernelConfig, got {}"),
    ],
)
def test_engine_settings_of_another_type_are_refused(pair, kwargs, message):
    with pytest.raises(TypeError, match=message):
        LLM(str(pair[0]), None, device="cpu", **kwargs)


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"num_speculative_tokens": "3"}, "SpeculativeConfig.num_speculative_tokens must be int or None, got '3'"),
        ({"num_speculative_tokens": 2.5}, "SpeculativeConfig.num_speculative_tokens must be int or None, got 2.5"),
        ({"adaptive_width": 1}, "SpeculativeConfig.adaptive_width must be bool, got 1"),
    ],
)
def test_speculative_settings_of_another_type_are_refused(pair, spec, message):
    with pytest.raises(TypeError, match=message):
        LLM(str(pair[0]), {"model": str(pair[1]), **spec}, device="cpu")


def test_max_model_len_below_one_is_refused_and_above_the_models_is_said(pair, caplog):
    with pytest.raises(ValueError, match="max_model_len must be >= 1"):
        LLM(str(pair[0]), None, device="cpu", max_model_len=-5)
    llm = LLM(str(pair[0]), None, device="cpu", max_model_len=100_000)
    assert llm.engine.max_model_len == 512 and "max_model_len 100000 is more than the model's context" in caplog.text


def test_numpy_sampling_params_pass():  # numbers as numpy gives them are numbers, bools are not
    p = SamplingParams(temperature=np.float32(0.7), top_p=np.float64(0.9), top_k=np.int64(5), seed=np.int32(3))
    assert (p.temperature, p.top_k) == (np.float32(0.7), 5)


def test_bad_prompts(pair):
    t, d = pair
    llm = LLM(str(t), {"model": str(d)}, device="cpu", max_model_len=64)
    with pytest.raises(ValueError, match=r"prompt token ids \[128, -1\] are outside the vocabulary \(size 128\)"):
        llm.generate([[5, 128, -1]])
    with pytest.raises(ValueError, match="the prompt has 64 tokens but the context holds 64"):
        llm.generate([[5] * 64])
    with pytest.raises(ValueError, match="the prompt is empty"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="no tokenizer: pass prompts as token-id lists"):
        llm.generate(["hello"])
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate([[5, 6]], SamplingParams(stop=["x"]))
    with pytest.raises(ValueError, match="the prompt is empty"):
        llm.generate([[5, 6], []])  # the good prompt before the bad one must not stay queued
    assert not llm.engine.has_unfinished()
    for _ in llm.stream([5, 6], SamplingParams(max_tokens=20, ignore_eos=True)):
        break  # a consumer that stops early frees its request
    assert (
        not llm.engine.has_unfinished()
        and llm.engine.scheduler.kv_cache_manager.num_free == llm.engine.scheduler.kv_cache_manager.num_usable
    )
    # a rejected request leaves the engine clean: the next one runs
    assert len(llm.generate([[5, 6]], SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids) == 3


def test_request_ids(pair):
    """A caller's id in use is refused; numbers that callers chose are skipped by automatic ids."""
    llm = LLM(str(pair[0]), None, device="cpu")
    last = int(llm.engine.add_request([5], SamplingParams()).request_id)
    taken = [str(last + i) for i in range(1, 4)]  # the next automatic ids
    for request_id in taken:
        llm.engine.add_request([5, 6], SamplingParams(max_tokens=2), request_id=request_id)
    with pytest.raises(ValueError, match=f"request id '{taken[0]}' is already in use"):
        llm.engine.add_request([5], SamplingParams(), request_id=taken[0])
    assert llm.engine.add_request([7, 8], SamplingParams()).request_id not in taken


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--model", "/no/such/model"], "/no/such/model: no such model directory"),
        (["--device", "tpu"], "device 'tpu' is not supported"),
        (["--dtype", "int8"], "dtype 'int8' is not supported"),
        (["--draft", "none", "--num-speculative-tokens", "3"], "set a drafter's block, and there is no drafter"),
        (["--draft", "none", "--compare"], "--compare and --show-drafts are about a drafter's work"),
    ],
)
def test_cli_bad_input_is_one_line(pair, capsys, flags, message):
    t, d = pair
    args = ["generate", "w", "--model", str(t), "--draft", str(d), "--device", "cpu", *flags]
    with pytest.raises(SystemExit) as exit_info:
        cli_main(args)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("blockspec: error: ") and message in err
    assert "Traceback" not in err


def test_cli_serve_without_the_server_packages_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if not installed: importing it fails
    monkeypatch.delitem(sys.modules, "blockspec.server.api", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["serve", "--device", "cpu"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "uvicorn is missing: pip install 'blockspec[serve]'" in err


def test_cli_refuses_both_block_width_flags(capsys):
    with pytest.raises(SystemExit) as exit_info:  # argparse's own usage error
        cli_main(["generate", "w", "--num-speculative-tokens", "3", "--block-size", "4"])
    err = capsys.readouterr().err
    assert (
        exit_info.value.code == 2 and "argument --block-size: not allowed with argument --num-speculative-tokens" in err
    )


def test_dtype_choice(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype(None, cpu) == torch.float32 and resolve_dtype(None, cuda) == torch.bfloat16
    monkeypatch.setattr(llm_module, "native_cpu_bf16", lambda: True)
    assert resolve_dtype("auto", cpu) == torch.bfloat16
    monkeypatch.setattr(llm_module, "native_cpu_bf16", lambda: False)
    assert resolve_dtype("auto", cpu) == torch.float32 and resolve_dtype("auto", cuda) == torch.bfloat16
    with pytest.raises(ValueError, match="dtype 'int8' is not supported"):
        resolve_dtype("int8", cpu)


def test_an_engine_refuses_a_fold_its_target_was_not_loaded_with(pair):
    """Folding is a load option: an engine asked for it on a target loaded otherwise says so
    instead of running the target as it is."""
    t, _ = pair
    target = load_target(str(t), torch.float32, torch.device("cpu"))
    with pytest.raises(
        ValueError, match="fold_norms=True is a load option: this target was loaded with its norms unfolded"
    ):
        LLMEngine(target, None, None, EngineConfig(fold_norms=True))
    assert LLMEngine(target, None, None, EngineConfig(fold_norms=False)).target is target
