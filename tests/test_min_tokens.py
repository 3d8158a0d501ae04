"""min_tokens: before a request has that many output tokens its eos and stop token ids are never
chosen (probability 0: greedy rows skip them, sampled rows never draw them, drafts of them are
rejected) and no stop string ends it; the same as transformers' min_new_tokens."""

import dataclasses

import torch
from conftest import make_drafter, make_target
from test_cuda_graphs import CpuGraphCache
from transformers import AutoModelForCausalLM

from blockspec import LLM, SamplingParams

PROMPTS = [[5, 9, 31], list(range(20, 45)), [7] * 3]


def test_greedy_min_tokens_equals_transformers_min_new_tokens(tmp_path):
    """The stop id is each prompt's third greedy token: without min_tokens the output ends there;
    with min_tokens 8, speculative and plain decoding both continue as transformers does with the
    stop id as its eos and min_new_tokens 8, through graph replays too."""
    target = make_target(tmp_path / "t", "qwen3", vocab=128)
    drafter = make_drafter(tmp_path / "d", target, block_size=6)
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    plain = LLM(str(target), None, "cpu")
    spec = LLM(str(target), {"model": str(drafter)}, "cpu")
    graphed = LLM(str(target), {"model": str(drafter)}, "cpu", async_steps=True)
    engine = graphed.engine
    engine.runner.graphs = CpuGraphCache(8, -(-engine.max_model_len // 16), engine.adaptive.classes)
    for prompt in PROMPTS:
        free = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
        stop = free.outputs[0].token_ids[2]
        sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop], min_tokens=8)
        with torch.no_grad():
            ids = hf.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=20, min_new_tokens=8, eos_token_id=stop
            )[0, len(prompt) :].tolist()
        for llm in (plain, spec, graphed):
            out = llm.generate([prompt], sp)[0].outputs[0]
            assert out.token_ids == ids and stop not in out.token_ids[:8]
        first = free.outputs[0].token_ids.index(stop)
        unbounded = plain.generate([prompt], dataclasses.replace(sp, min_tokens=0))[0].outputs[0]
        assert unbounded.token_ids == free.outputs[0].token_ids[: first + 1]


def test_sampled_min_tokens_never_draws_a_stop_early(tmp_path):
    """Seeded samples at T 1.5 with the most likely first token as the stop id: never among the
    first 6 tokens (speculative: drafts of it rejected), and it does end some outputs after them."""
    target = make_target(tmp_path / "t", "qwen3", vocab=128)
    drafter = make_drafter(tmp_path / "d", target, block_size=6)
    llm = LLM(str(target), {"model": str(drafter)}, "cpu")
    stop = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=1))[0].outputs[0].token_ids[0]
    params = [
        SamplingParams(temperature=1.5, seed=s, max_tokens=40, ignore_eos=True, stop_token_ids=[stop], min_tokens=6)
        for s in range(24)
    ]
    outs = [o.outputs[0].token_ids for o in llm.generate([PROMPTS[0]] * 24, params)]
    assert all(stop not in ids[:6] and len(ids) >= 6 for ids in outs)
    assert any(ids[-1] == stop for ids in outs)
