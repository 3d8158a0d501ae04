"""Our targets against transformers' own models: same logits, through the paged path."""

import pytest
import torch
from conftest import make_drafter, make_target
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from blockspec import LLM
from blockspec.engine.kv_cache import allocate_caches
from blockspec.engine.kv_cache_manager import KVCacheManager
from blockspec.engine.runner import ModelRunner
from blockspec.engine.sequence import Sequence
from blockspec.layers.norm import RMSNorm, fold_norm_weight
from blockspec.layers.recurrent_state import RecurrentStates
from blockspec.loading.hf import load_target
from blockspec.loading.weights import CheckpointError
from blockspec.sampling import SamplingParams

CASES = [
    ("llama", False, "none"),
    ("llama", True, "llama3"),
    ("llama", False, "linear"),
    ("qwen2", True, "none"),
    ("qwen2", False, "yarn"),
    ("qwen3", False, "none"),
    ("qwen3", True, "yarn"),
    ("qwen3", False, "llama3"),
]


def paged_logits(model, ids: list[int], split: int, page_size: int = 4) -> torch.Tensor:
    """Logits of ids[split:], with ids[:split] processed first into the paged cache."""
    cache = allocate_caches(model.layers, 64, page_size, 2, torch.float32, "cpu")
    runner = ModelRunner(model, None, cache, None, page_size)
    seq = Sequence(None, ids, SamplingParams(), 0)
    KVCacheManager((None,), [64], page_size, False).allocate(seq, len(ids))
    seq.state_slot = 1
    seq.token_ids = ids[: split + 1]  # prefill processes all but the last ("anchor")
    runner.prefill([seq])
    rest = ids[split:]
    ids_t, *inputs, slots = runner.tensors([rest], [split], [len(rest)], runner.host_block_tables([seq]), [1])
    with torch.inference_mode():
        hidden, _ = runner.target_forward(ids_t, *inputs, RecurrentStates(slots, inputs[0], inputs[1]))
        return model.compute_logits(hidden)[0]


@pytest.mark.parametrize(
    "family,tied,rope,extra",
    [c + ({},) for c in CASES]
    + [
        ("llama", False, "none", {"attention_bias": True, "mlp_bias": True}),
        ("qwen3", False, "none", {"attention_bias": True, "num_key_value_heads": 4}),  # biased, no GQA
        # sliding window (layers from max_window_layers on) shorter than the 90 tokens
        ("qwen2", False, "none", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}),
        ("qwen3", True, "yarn", {"use_sliding_window": True, "sliding_window": 7, "max_window_layers": 2}),
    ],
)
def test_logits_match_transformers(tmp_path, family, tied, rope, extra):
    path = make_target(tmp_path / "t", family, tied, rope, **extra)
    ours = load_target(path, torch.float32, torch.device("cpu")).model
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(0, 128, (90,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    got = paged_logits(ours, ids, split=70)  # positions past original_max_position_embeddings (64)
    torch.testing.assert_close(got, expected[70:], atol=2e-5, rtol=1e-4)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight if tied else True


def test_sliding_window_target_decodes_as_transformers(tmp_path):
    """Greedy decoding past the window, plain and speculative, equals transformers' generate."""
    t = make_target(tmp_path / "t", "qwen2", use_sliding_window=True, sliding_window=6, max_window_layers=2)
    d = make_drafter(tmp_path / "d", t, block_size=4)
    ref = AutoModelForCausalLM.from_pretrained(t, dtype=torch.float32).eval()
    prompt = [5, 9, 17, 3, 40, 41, 42]
    expected = ref.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, eos_token_id=None)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for spec in (None, {"model": str(d)}):
        out = LLM(str(t), spec, device="cpu", page_size=4).generate([prompt], params)[0].outputs[0].token_ids
        assert out == expected[0, len(prompt) :].tolist()


def test_sharded_checkpoint_loads(tmp_path):
    path = make_target(tmp_path / "t", "qwen3")
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ref.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    a = load_target(path, torch.float32, torch.device("cpu")).model
    b = load_target(tmp_path / "sharded", torch.float32, torch.device("cpu")).model
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(x, y), name


def test_tied_config_with_its_own_lm_head(tmp_path):
    """A tied config whose file still holds a different lm_head.weight: transformers keeps that
    head (it does not tie), and so do we; an lm_head equal to the embedding stays tied, and so does
    one stored instead of the embedding (it serves both)."""
    path = make_target(tmp_path / "t", "qwen3", tied=True)
    weights = load_file(path / "model.safetensors")
    embed = weights["model.embed_tokens.weight"]
    no_embed = {n: t for n, t in weights.items() if n != "model.embed_tokens.weight"}
    ids = torch.randint(0, 128, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    for base, head, tied in (
        (weights, torch.randn_like(embed), False),
        (weights, embed.clone(), True),
        (no_embed, embed, True),
    ):
        save_file({**base, "lm_head.weight": head}, path / "model.safetensors")
        ours = load_target(path, torch.float32, torch.device("cpu")).model
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            expected = ref(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(paged_logits(ours, ids, split=10), expected[10:], atol=2e-5, rtol=1e-4)
        assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied
    save_file({**no_embed, "lm_head.weight": embed[:-1]}, path / "model.safetensors")  # one row short
    with pytest.raises(CheckpointError, match=r"lm_head\.weight has shape \(127, 64\), expected \(128, 64\)"):
        load_target(path, torch.float32, torch.device("cpu"))


def test_llm_loads_the_target_folded_as_asked(tmp_path):
    """LLM folds the norm weights into the GEMMs at load (`fold_norms`; by default where the fused
    GEMMs run, not on the CPU), and the folded target decodes as the unfolded one."""
    path = make_target(tmp_path / "t", "qwen3", attention_bias=True)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert not LLM(str(path), None, device="cpu").engine.target.model.norms_folded
    outs = []
    for fold in (True, False):
        llm = LLM(str(path), None, device="cpu", fold_norms=fold)
        assert llm.engine.target.model.norms_folded == fold
        outs.append(llm.generate([[5, 9, 17, 3, 40, 41, 42, 43]], params)[0].outputs[0].token_ids)
    assert outs[0] == outs[1]


def test_a_bf16_fold_rounds_once_as_the_mma_kernel_does():
    """The folded bf16 weight is bit for bit the weight tile the 16-row kernel multiplied by g at
    every call before the fold: (w * g) in float32, rounded once to bf16, per input feature."""
    gen = torch.Generator().manual_seed(4)
    linear = torch.nn.Linear(64, 48, bias=False).to(torch.bfloat16)
    norm = RMSNorm(64, 1e-6).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 64, generator=gen))
        norm.weight.copy_(torch.rand(64, generator=gen) * 3 + 0.1)
    w, g = linear.weight.detach().clone(), norm.weight.detach().clone()
    fold_norm_weight(norm, linear)
    assert norm.weight is None
    assert torch.equal(linear.weight, (w.float() * g.float()[None, :]).to(torch.bfloat16))
