"""Prefix caching: requests that share a prompt prefix share its K/V pages (target's and drafter's),
and nothing they output changes: tokens and the drafter's drafts equal a run without the cache,
greedy and seeded; freed pages stay reusable until evicted, tail first."""

import pytest
import torch
from conftest import make_drafter, make_target
from test_hybrid_targets import hybrid_target

from blockspec import LLM, SamplingParams
from blockspec.engine.kv_cache_manager import BlockTable, KVCacheManager
from blockspec.engine.sequence import Sequence

PAGE = 4


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix")
    target = make_target(root / "t", "qwen3", vocab=128)
    return target, make_drafter(root / "d", target, block_size=6)


def load(pair, prefix_caching: bool) -> LLM:
    target, drafter = pair
    spec = {"model": str(drafter), "adaptive_width": False}  # widths that do not depend on timing
    return LLM(str(target), spec, "cpu", page_size=PAGE, prefix_caching=prefix_caching)


def requests() -> tuple[list[list[int]], list[SamplingParams]]:
    """Six prompts on one 41-token system prefix (10 whole pages and a token), greedy and seeded."""
    gen = torch.Generator().manual_seed(0)
    system = torch.randint(3, 127, (41,), generator=gen).tolist()
    prompts = [system + torch.randint(3, 127, (3 + i,), generator=gen).tolist() for i in range(6)]
    params = [
        SamplingParams(temperature=0.8 if i % 2 else 0, seed=i, max_tokens=12, ignore_eos=True, return_drafts=True)
        for i in range(6)
    ]
    return prompts, params


def run(llm: LLM, one_at_a_time: bool) -> list[tuple[list[int], list[list[int]]]]:
    """Each request's tokens and its drafts, step by step."""
    prompts, params = requests()
    if one_at_a_time:
        outs = [llm.generate([p], sp)[0] for p, sp in zip(prompts, params)]
    else:
        outs = llm.generate(prompts, params)
    return [(o.outputs[0].token_ids, o.metrics.draft_token_ids) for o in outs]


@pytest.mark.parametrize("one_at_a_time", [True, False], ids=["sequential", "batched"])
def test_outputs_and_drafts_equal_a_run_without_the_cache(pair, one_at_a_time):
    """Later requests hold the first one's system-prompt pages, all five others: sequentially, and
    batched too, where they wait a step for the first one's prefill instead of computing the
    prefix again. The drafter's context K/V comes with them: every step drafts the same tokens as
    without the cache."""
    cached = load(pair, prefix_caching=True)
    assert run(cached, one_at_a_time) == run(load(pair, prefix_caching=False), one_at_a_time)
    allocator = cached.engine.scheduler.kv_cache_manager
    prompts, _ = requests()
    assert allocator.queries == sum(len(p) - 1 for p in prompts)
    assert allocator.hits == 5 * 10 * PAGE


def test_a_repeated_prompt_skips_its_prefill(pair):
    """The same prompt again: every whole page before the anchor is a hit, and only the rest is
    prefilled; repeating a finished request's prompt also hits the pages its output filled."""
    llm = load(pair, prefix_caching=True)
    prompt = list(range(3, 30))  # 27 tokens: 6 whole pages before the anchor
    first = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=9))[0]
    prefilled = []
    prefill = llm.engine.runner.prefill
    llm.engine.runner.prefill = lambda seqs, counts: (prefilled.append(counts), prefill(seqs, counts))
    assert llm.generate([prompt], SamplingParams(temperature=0, max_tokens=9))[0].outputs == first.outputs
    longer = prompt + first.outputs[0].token_ids  # 36 tokens: 8 whole pages, its output's included
    llm.generate([longer], SamplingParams(temperature=0, max_tokens=2))
    assert prefilled == [[26 - 6 * PAGE], [35 - 8 * PAGE]]


def test_freed_pages_are_reused_then_evicted_tail_first():
    """A finished sequence's registered pages stay cached; a pool short of free pages evicts the
    one freed longest ago, and a sequence's last page before its first, so the prefix's head
    still hits."""
    pages = KVCacheManager((None,), [5], page_size=2, prefix_caching=True)
    (pool,) = pages.groups
    seq = Sequence(None, [1, 2, 3, 4, 5, 6, 7], SamplingParams(), seed=0)
    pages.allocate(seq, 7)  # pages 1-4
    seq.num_cached = 6
    pages.register(seq)  # the first 3 pages are computed
    pages.free(seq)
    assert pool.num_free == 4 and list(pool.evictable) == [3, 2, 1]
    other = BlockTable()
    pool.allocate(other, 4)  # the free page 4, then the cache's oldest: page 3
    assert other.pages == [4, 3] and list(pool.evictable) == [2, 1]
    again = Sequence(None, [1, 2, 3, 4, 5, 6, 9], SamplingParams(), seed=0)
    assert pages.match_prefix(again) == 4 and again.block_tables[0].pages == [1, 2]
    assert pool.num_free == 0


def test_hybrid_targets_keep_prefix_caching_off(tmp_path):
    """A linear-attention state is no page: the cache cannot skip those layers."""
    path = hybrid_target(tmp_path, "qwen3_5")
    assert not LLM(str(path), device="cpu").engine.scheduler.kv_cache_manager.prefix_caching
    with pytest.raises(ValueError, match="prefix_caching: this target's linear-attention layers"):
        LLM(str(path), device="cpu", prefix_caching=True)
