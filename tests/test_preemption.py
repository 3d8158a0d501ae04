"""Many requests through a deliberately small KV pool: sequences are preempted and
recomputed, and every output equals that request run alone."""

import pytest
import torch
from conftest import count_launches_ahead, make_drafter, make_target
from test_hybrid_targets import hybrid_target
from test_moe_targets import moe_target

from blockspec import LLM, SamplingParams


# gpt-oss: sliding layers, sinks, experts; Qwen3-Next: recurrent states in slots, recomputed after preemption
@pytest.mark.parametrize("family", ["qwen3", "gpt_oss", "qwen3_next"])
@pytest.mark.parametrize("async_steps", [False, True], ids=["lock-step", "launched-ahead"])
def test_small_pool_preempts_without_changing_outputs(tmp_path, async_steps, family):
    makers = {
        "qwen3": lambda: make_target(tmp_path / "t", "qwen3", vocab=128),
        "gpt_oss": lambda: moe_target(tmp_path, family),
    }
    t = makers.get(family, lambda: hybrid_target(tmp_path, family))()
    d = make_drafter(tmp_path / "d", t, block_size=6)
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, 127, (int(n),), generator=gen).tolist() for n in torch.randint(1, 30, (12,), generator=gen)
    ]
    params = [
        SamplingParams(temperature=0 if i % 2 else 0.9, seed=i, max_tokens=10 + 3 * i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    spec = {"model": str(d)}
    # 14 usable pages of 4 tokens hold one longest sequence (max_model_len 48 + block) but not many.
    small = LLM(str(t), spec, device="cpu", page_size=4, num_pages=15, max_model_len=48, async_steps=async_steps)
    launched = count_launches_ahead(small)
    outs = small.generate(prompts, params)
    assert any(launched) == async_steps  # launched ahead between preemptions (105 of 186 steps measured)
    assert small.engine.scheduler.num_preemptions > 0
    pages = small.engine.scheduler.kv_cache_manager
    assert pages.groups[0].num_free == 14  # every page came back, in the sliding layers' pool too
    assert pages.free_pages() == [g.num_usable for g in pages.groups]
    assert small.engine.scheduler.slots.num_free == small.engine.config.max_num_seqs  # and every state slot
    alone = LLM(str(t), spec, device="cpu", page_size=4, max_model_len=48)
    for p, sp, o in zip(prompts, params, outs):
        ref = alone.generate([p], sp)[0]
        assert o.outputs[0].token_ids == ref.outputs[0].token_ids
        assert o.outputs[0].finish_reason == ref.outputs[0].finish_reason


def test_narrow_steps_near_the_context_end_fit_one_sequences_pages(tmp_path):
    """A step holds pages for the drafter's whole block, cut at max_model_len as the drafter's
    rows are: a pool of exactly one sequence's pages (10 of 4 tokens, plus the trash page) runs a
    request to its context's end, also with a step far narrower than the block."""
    t = make_target(tmp_path / "t", "qwen3", vocab=128)
    d = make_drafter(tmp_path / "d", t, block_size=8)
    spec = {"model": str(d), "num_speculative_tokens": 1}
    llm = LLM(str(t), spec, device="cpu", page_size=4, max_model_len=40, num_pages=11)
    seq = llm.engine.add_request([5, 9, 11], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    for _ in range(40):  # at least one token a step: bounded, where pages that never fit would loop
        if seq.finished:
            break
        llm.engine.step()
    assert (seq.finish_reason, seq.num_generated) == ("length", 37)
