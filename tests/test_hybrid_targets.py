"""Hybrid linear-attention targets (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) against transformers' own
models: logits through the paged path with a prefix already cached, greedy decoding plain and
speculative under many rejection patterns, the state rollback, preemption, and the published
checkpoints' layouts."""

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    assert_greedy_equals_transformers_generate,
    make_drafter,
    make_target,
    meta_tensors,
    published_target,
)
from safetensors.torch import load_file, save_file
from test_target_logits import paged_logits
from transformers import AutoModelForCausalLM, PretrainedConfig, Qwen3_5MoeTextConfig
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5_modeling
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as qwen3_5_moe_modeling
from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next_modeling

import blockspec.engine.engine as engine_module
from blockspec import LLM
from blockspec.layers.gated_deltanet import fla_kernels, gated_delta_rule_ref, masked
from blockspec.loading.hf import load_target
from blockspec.loading.weights import CheckpointError, check_tensors
from blockspec.models.registry import family_for
from blockspec.sampling import SamplingParams

FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]


def vary_weights(path) -> None:
    """The norms' offsets, the decays and the gated norm away from transformers' init (offsets 0,
    dt_bias 1, gated norm 1), so that an offset ignored or added twice, or a decay misread, shows."""
    file, gen = path / "model.safetensors", torch.Generator().manual_seed(7)
    weights = load_file(file)
    for name, t in weights.items():
        if name.endswith(("norm.weight", "dt_bias", "A_log")):
            weights[name] = t + torch.randn(t.shape, generator=gen) * 0.3
    save_file(weights, file, {"format": "pt"})


def hybrid_target(tmp_path, family: str, **extra):
    path = make_target(tmp_path / "t", family, **extra)
    vary_weights(path)
    return path


def as_conditional_generation(path) -> None:
    """The checkpoint as the published Qwen3.5 ones are: the text model under
    `model.language_model.` with a vision tower beside it and multi-token-prediction layers, the
    text config nested."""
    file = path / "model.safetensors"
    weights = {n.replace("model.", "model.language_model.", 1): t for n, t in load_file(file).items()}
    weights["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(3, 3)
    weights["mtp.fc.weight"] = torch.zeros(3, 3)
    save_file(weights, file, {"format": "pt"})
    text = json.loads((path / "config.json").read_text())
    config = {
        "architectures": [text["architectures"][0].replace("ForCausalLM", "ForConditionalGeneration")],
        "model_type": text["model_type"].removesuffix("_text"),
        "text_config": text,
        "vision_config": {},
        "tie_word_embeddings": text["tie_word_embeddings"],
    }
    (path / "config.json").write_text(json.dumps(config))


@pytest.fixture
def recurrent_transformers(monkeypatch):
    """transformers' hybrid models running their row-by-row recurrence for prompts too. Their
    chunked one (the default for more than one row) differs from it by up to 2e-4 in these
    logits, in fp32: the oracle for ours (row by row) is theirs row by row."""
    for module in (qwen3_5_modeling, qwen3_5_moe_modeling, qwen3_next_modeling):
        recurrent = module.torch_recurrent_gated_delta_rule
        monkeypatch.setattr(
            module, "torch_chunk_gated_delta_rule", lambda *a, chunk_size=64, f=recurrent, **kw: f(*a, **kw)
        )


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tied", [False, True])
def test_logits_match_transformers(tmp_path, family, tied, recurrent_transformers):
    path = hybrid_target(tmp_path, family, tied=tied)
    ours = load_target(path, torch.float32, torch.device("cpu")).model
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(0, 128, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    for split in (1, 37, 54, 69):  # prefixes already cached: none, long, verify-sized tail, one-row decode
        torch.testing.assert_close(paged_logits(ours, ids, split=split), expected[split:], atol=1e-4, rtol=1e-4)


def test_conditional_generation_checkpoint_loads_its_text_model(tmp_path, caplog):
    path = hybrid_target(tmp_path, "qwen3_5_moe")
    ids = [5, 9, 17, 3, 40, 41, 42]
    before = paged_logits(load_target(path, torch.float32, torch.device("cpu")).model, ids, split=3)
    as_conditional_generation(path)
    after = paged_logits(load_target(path, torch.float32, torch.device("cpu")).model, ids, split=3)
    assert torch.equal(before, after)
    assert "its text model is loaded, its vision tower is not" in caplog.text  # the note says what is left out


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_plain_and_speculative_equal_transformers_generate(tmp_path, family):
    t = hybrid_target(tmp_path, family)
    assert_greedy_equals_transformers_generate(t, make_drafter(tmp_path / "d", t, block_size=4))


@pytest.mark.parametrize("family", FAMILIES)
def test_speculative_equals_plain_over_random_rejections(tmp_path, family, random_oracle):
    """Blocks right for a random number of drafts (0 to all) each step: the states rolled back to
    every accepted prefix give plain decoding's tokens, one request or many at once."""
    t = hybrid_target(tmp_path, family)
    d = make_drafter(tmp_path / "d", t, block_size=8)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 127, (int(n),), generator=gen).tolist() for n in (1, 5, 13, 29)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(str(t), None, device="cpu").generate(prompts, params)]
    for p, o in zip(prompts, plain):
        random_oracle[tuple(p)] = o
    spec = LLM(str(t), {"model": str(d), "adaptive_width": False}, device="cpu", page_size=4)
    outs = spec.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == plain
    accepted = [a - 1 for o in outs for a in o.metrics.acceptance_lengths]
    assert set(range(8)) <= set(accepted)  # every acceptance count, 0 to all 7 drafts, occurred
    for p, o in zip(prompts, plain):
        assert spec.generate([p], params)[0].outputs[0].token_ids == o


def test_replayed_state_equals_the_state_after_the_accepted_rows():
    """The rollback's replay over the first n rows of a block (rows past n given g = beta = 0)
    gives exactly the state that a forward over those n rows alone leaves."""
    gen = torch.Generator().manual_seed(0)
    B, T, Hk, Hv, D = 3, 6, 2, 4, 8
    q, k = torch.randn(B, T, Hk, D, generator=gen), torch.randn(B, T, Hk, D, generator=gen)
    v = torch.randn(B, T, Hv, D, generator=gen)
    g, beta = -torch.rand(B, T, Hv, generator=gen), torch.rand(B, T, Hv, generator=gen)
    state = torch.randn(B, Hv, D, D, generator=gen)
    rows = torch.tensor([0, 2, 6])
    gm, bm = masked(g, beta, rows)
    _, replayed = gated_delta_rule_ref(q, k, v, gm, bm, state)
    for b, n in enumerate(rows.tolist()):
        _, alone = gated_delta_rule_ref(
            q[b : b + 1, :n],
            k[b : b + 1, :n],
            v[b : b + 1, :n],
            g[b : b + 1, :n],
            beta[b : b + 1, :n],
            state[b : b + 1],
        )
        assert torch.equal(replayed[b], alone[0])


def test_gated_delta_rule_reference_is_the_chunk_free_recurrence():
    """The reference against the recurrence written out for one head: the state decays, takes
    the delta rule's correction, and is read by the normed, scaled query."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, 1, 8, generator=gen) for _ in range(3))
    g, beta = -torch.rand(1, 4, 1, generator=gen), torch.rand(1, 4, 1, generator=gen)
    out, final = gated_delta_rule_ref(q, k, v, g, beta, torch.zeros(1, 1, 8, 8))
    S = torch.zeros(8, 8)
    for t in range(4):
        qt, kt = q[0, t, 0] / q[0, t, 0].norm() * 8**-0.5, k[0, t, 0] / k[0, t, 0].norm()
        S = S * g[0, t, 0].exp()
        S = S + torch.outer(kt, beta[0, t, 0] * (v[0, t, 0] - S.T @ kt))
        torch.testing.assert_close(out[0, t, 0], S.T @ qt, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final[0, 0], S, atol=1e-5, rtol=1e-5)


def test_missing_linear_attention_kernels_name_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "fla", None)  # an import of it fails, as where it is not installed
    with pytest.raises(ValueError, match=r"fla-core is not installed: pip install 'blockspec\[hybrid\]'"):
        fla_kernels()


def test_hybrid_configs_that_cannot_run_are_refused(tmp_path, monkeypatch):
    path = hybrid_target(tmp_path, "qwen3_5")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"linear_num_key_heads": 0}))
    with pytest.raises(CheckpointError, match="linear_num_key_heads must be a positive integer, got 0"):
        load_target(path, torch.float32, torch.device("cpu"))
    (path / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(engine_module, "CPU_KV_BUDGET", 100_000)  # less than 65 sequences' states
    with pytest.raises(
        ValueError,
        match=r"states of max_num_seqs 64 sequences and 64 state_checkpoints take .* lower max_num_seqs or state_ch",
    ):
        LLM(str(path), None, device="cpu")
    with pytest.raises(ValueError, match=r"states of max_num_seqs 64 sequences take .* lower max_num_seqs$"):
        LLM(str(path), None, device="cpu", prefix_caching=False)


def test_qwen3_5_moe_routes_every_layer_and_renormalizes_as_transformers_does():
    """transformers' Qwen3.5-MoE builds every MLP sparse and renormalizes the top k, whatever the
    config says of `mlp_only_layers` or `norm_topk_prob`; Qwen3-Next reads both."""
    config = Qwen3_5MoeTextConfig(num_hidden_layers=4, num_experts=8, num_experts_per_tok=2)
    config.mlp_only_layers, config.norm_topk_prob = [1], False
    family = family_for(PretrainedConfig(architectures=["Qwen3_5MoeForCausalLM"]))
    assert [k.mlp for k in family.layer_kinds(config)] == ["sparse_moe"] * 4
    assert family.layer_spec(config).moe.norm_topk_prob


def test_mismatched_linear_attention_checkpoint_fails_naming_the_tensor(tmp_path):
    path = hybrid_target(tmp_path, "qwen3_next")
    file = path / "model.safetensors"
    weights = load_file(file)
    name = "model.layers.0.linear_attn.in_proj_qkvz.weight"
    weights[name] = weights[name][:-8]
    save_file(weights, file, {"format": "pt"})
    with pytest.raises(CheckpointError, match="in_proj_qkvz"):
        load_target(path, torch.float32, torch.device("cpu"))


TARGET_FIXTURES = Path(__file__).parent / "fixtures" / "targets"


def qwen3_next_tensors(config) -> dict[str, torch.Tensor]:
    """Qwen3-Next's published layout (SOURCES.md): fused, group-interleaved linear-attention
    projections, experts stored one by one, a shared expert, no vision tower."""
    H, la_k, la_v, D = config.hidden_size, config.linear_num_key_heads, config.linear_num_value_heads, 128
    heads, kv, hd, E, inter = (
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.num_experts,
        config.moe_intermediate_size,
    )
    shapes = {
        "model.embed_tokens.weight": (config.vocab_size, H),
        "lm_head.weight": (config.vocab_size, H),
        "model.norm.weight": (H,),
    }
    for i, kind in enumerate(config.layer_types):
        p = f"model.layers.{i}"
        shapes |= {f"{p}.input_layernorm.weight": (H,), f"{p}.post_attention_layernorm.weight": (H,),
                   f"{p}.mlp.gate.weight": (E, H), f"{p}.mlp.shared_expert_gate.weight": (1, H),
                   f"{p}.mlp.shared_expert.gate_proj.weight": (512, H), f"{p}.mlp.shared_expert.up_proj.weight": (512, H),
                   f"{p}.mlp.shared_expert.down_proj.weight": (H, 512)}  # fmt: skip
        for e in range(E):
            x = f"{p}.mlp.experts.{e}"
            shapes |= {
                f"{x}.gate_proj.weight": (inter, H),
                f"{x}.up_proj.weight": (inter, H),
                f"{x}.down_proj.weight": (H, inter),
            }
        if kind == "linear_attention":
            a = f"{p}.linear_attn"
            shapes |= {f"{a}.in_proj_qkvz.weight": (2 * la_k * D + 2 * la_v * D, H), f"{a}.in_proj_ba.weight": (2 * la_v, H),
                       f"{a}.conv1d.weight": (2 * la_k * D + la_v * D, 1, 4), f"{a}.A_log": (la_v,), f"{a}.dt_bias": (la_v,),
                       f"{a}.norm.weight": (D,), f"{a}.out_proj.weight": (H, la_v * D)}  # fmt: skip
        else:
            a = f"{p}.self_attn"
            shapes |= {f"{a}.q_proj.weight": (2 * heads * hd, H), f"{a}.k_proj.weight": (kv * hd, H),
                       f"{a}.v_proj.weight": (kv * hd, H), f"{a}.o_proj.weight": (H, heads * hd),
                       f"{a}.q_norm.weight": (hd,), f"{a}.k_norm.weight": (hd,)}  # fmt: skip
    return {n: torch.empty(s, dtype=torch.bfloat16, device="meta") for n, s in shapes.items()}


# folder -> (layers, linear-attention layers, value heads, experts (0: dense), shared expert width)
PUBLISHED = {
    "Qwen--Qwen3.6-27B": (64, 48, 48, 0, 0),
    "Qwen--Qwen3.6-35B-A3B": (40, 30, 32, 256, 512),
    "Qwen--Qwen3-Next-80B-A3B-Instruct": (48, 36, 32, 512, 512),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_targets_build_with_every_tensor(name):
    """The published hybrid targets' config.json select their family and build on the meta device;
    their tensors (the vision tower's and the multi-token-prediction layers' left out) fill every
    parameter, none left over."""
    folder = TARGET_FIXTURES / name
    config, family, model = published_target(folder)
    if (folder / "tensors.json").is_file():
        tensors = meta_tensors(folder)
    else:
        tensors = qwen3_next_tensors(config)
    renamed = {new: t for n, t in tensors.items() if (new := family.weights.rename(n)) is not None}
    converted = family.weights.to_model(tensors, family.layer_spec(config), folder)
    check_tensors(model, converted, folder)
    assert len(renamed) < len(tensors) or "Next" in name  # the vision tower and MTP layers were left out
    layers, linear, value_heads, experts, shared = PUBLISHED[name]
    kinds = [layer.cache_kind for layer in model.layers]
    assert (len(kinds), kinds.count("recurrent_state")) == (layers, linear)
    assert model.spec.linear_attention.num_value_heads == value_heads
    moe = model.spec.moe
    assert (moe.num_experts, moe.shared_expert_intermediate_size) == (experts, shared) if experts else moe is None
    assert model.rotary.inv_freq.numel() * 2 == model.spec.head_dim // 4  # rope on a quarter of each head
