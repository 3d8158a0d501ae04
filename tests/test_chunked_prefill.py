"""Chunked prefill: a prompt longer than the step's token budget is prefilled over several steps,
while the running sequences decode between its chunks; outputs and drafts equal an unchunked
prefill's, for attention, sliding-window and linear-attention targets."""

import pytest
import torch
from conftest import make_drafter, make_target
from test_hybrid_targets import hybrid_target
from test_moe_targets import moe_target

from blockspec import LLM, SamplingParams

TARGETS = {
    "qwen3": lambda tmp: make_target(tmp / "t", "qwen3", vocab=128),
    "gpt_oss": lambda tmp: moe_target(tmp, "gpt_oss"),  # sliding window 8: chunks cross it
    "qwen3_5": lambda tmp: hybrid_target(tmp, "qwen3_5"),  # states carried from chunk to chunk
}


def run(target, drafter, budget: int) -> tuple[list[tuple[list[int], list[list[int]]]], list[list[int]]]:
    """Each request's tokens and drafts, and the chunk sizes of every prefill."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 127, (n,), generator=gen).tolist() for n in (3, 29, 11, 40)]
    params = [
        SamplingParams(temperature=0.8 if i % 2 else 0, seed=i, max_tokens=10, ignore_eos=True, return_drafts=True)
        for i in range(len(prompts))
    ]
    spec = {"model": str(drafter), "adaptive_width": False}
    llm = LLM(str(target), spec, "cpu", page_size=4, max_num_batched_tokens=budget, prefix_caching=False)
    chunks, prefill = [], llm.engine.runner.prefill
    llm.engine.runner.prefill = lambda seqs, counts: (chunks.append(counts), prefill(seqs, counts))
    return [(o.outputs[0].token_ids, o.metrics.draft_token_ids) for o in llm.generate(prompts, params)], chunks


@pytest.mark.parametrize("family", list(TARGETS))
def test_chunked_equals_unchunked(tmp_path, family):
    """Chunks of 7 tokens (none aligned to the pages of 4) against whole prompts: the same tokens
    and the same drafts, step for step, greedy and seeded."""
    target = TARGETS[family](tmp_path)
    drafter = make_drafter(tmp_path / "d", target, block_size=6)
    (chunked, chunks), (whole, wholes) = run(target, drafter, budget=7), run(target, drafter, budget=1000)
    assert chunked == whole
    assert wholes == [[2, 28, 10, 39]]  # every prompt (less its anchor) in one prefill
    # the same 79 tokens in steps of at most 7 rows, padding included: the long prompts were cut
    assert sum(n for step in chunks for n in step) == 79
    assert all(len(step) * max(step) <= 7 for step in chunks)


def test_running_sequences_decode_between_a_long_prompts_chunks(tmp_path):
    """A 60-token prompt arriving with a budget of 8 tokens a step takes 8 steps to prefill; the
    sequence already running gets tokens in each of them."""
    target = make_target(tmp_path / "t", "qwen3", vocab=128)
    llm = LLM(str(target), device="cpu", max_num_batched_tokens=8)
    engine = llm.engine
    running = engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    engine.step()
    long = engine.add_request(list(range(3, 63)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    steps = 0
    while long.needs_prefill or long.num_generated == 0:
        before = running.num_generated
        engine.step()
        steps += 1
        assert running.num_generated > before
    assert steps >= 8


def test_a_prefill_pads_to_at_most_the_budget(tmp_path):
    """Chunks run padded to the longest: a 10-token chunk and a 3-token one would be 20 rows,
    past a budget of 16, so the second waits for the next step."""
    target = make_target(tmp_path / "t", "qwen3", vocab=128)
    engine = LLM(str(target), device="cpu", max_num_batched_tokens=16).engine
    long, short = (engine.add_request(list(range(3, 3 + n)), SamplingParams(max_tokens=2)) for n in (11, 4))
    engine.scheduler.admit()
    assert [(s, n) for s, n in engine.scheduler.prefill_chunks()] == [(long, 10)]
    long.num_cached = 10
    assert engine.scheduler.prefill_chunks() == [(short, 3)]
