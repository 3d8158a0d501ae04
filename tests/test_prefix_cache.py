"""Prefix caching: requests that share a prompt prefix share its K/V pages (target's and drafter's)
and, on linear-attention targets, checkpoints of its states, and nothing they output changes:
tokens and the drafter's drafts equal a run without the cache, greedy and seeded; freed pages stay
reusable until evicted, tail first."""

import pytest
import torch
from conftest import make_drafter, make_target
from test_hybrid_targets import hybrid_target

from blockspec import LLM, SamplingParams
from blockspec.engine.kv_cache_manager import BlockTable, KVCacheManager, StateCheckpoints
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


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def hybrid_pair(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    target = hybrid_target(root, request.param)
    return target, make_drafter(root / "d", target, block_size=6)


@pytest.mark.parametrize("one_at_a_time", [True, False], ids=["sequential", "batched"])
def test_hybrid_outputs_and_drafts_equal_a_run_without_the_cache(hybrid_pair, one_at_a_time):
    """A linear-attention target: the first request on the system prompt leaves no checkpoint (its
    prefill does not end on a page boundary), the second ends a prefill chunk where its pages match
    (40 tokens) and checkpoints the states there, the four others restore them and skip those 40
    tokens. Batched too: the others wait for the first one's prefill, then for the second one's
    checkpoint. Tokens and drafts equal a run without the cache."""
    cached = load(hybrid_pair, prefix_caching=True)
    assert run(cached, one_at_a_time) == run(load(hybrid_pair, prefix_caching=False), one_at_a_time)
    pages = cached.engine.scheduler.kv_cache_manager
    assert pages.hits == 4 * 10 * PAGE
    assert len(pages.checkpoints.slots) == 3  # at 40, and where two prefills end on a page (44, 48)


def test_hybrid_checkpoints_evict_least_recently_used(hybrid_pair):
    """Two checkpoints kept, three system prompts (a, b, c): each prompt's second request
    checkpoints its 20-token prefix; a's third request restores it, c's checkpoint then takes b's
    place and b's the place of a's, so b and a compute theirs again. Outputs equal a run without
    the cache."""
    target, drafter = hybrid_pair
    gen = torch.Generator().manual_seed(1)
    systems = [torch.randint(3, 127, (21,), generator=gen).tolist() for _ in range(3)]
    order = [0, 0, 1, 1, 0, 2, 2, 1, 0]
    prompts = [systems[i] + torch.randint(3, 127, (2,), generator=gen).tolist() for i in order]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = []
    for caching in (True, False):
        llm = LLM(
            str(target), {"model": str(drafter)}, "cpu", page_size=PAGE, prefix_caching=caching, state_checkpoints=2
        )
        outs.append([llm.generate([p], params)[0].outputs[0].token_ids for p in prompts])
        if caching:
            pages = llm.engine.scheduler.kv_cache_manager
            assert pages.hits == 5 * PAGE and len(pages.checkpoints.slots) == 2  # one restore, two evictions
    assert outs[0] == outs[1]


def test_state_checkpoints_are_kept_by_prefix_and_given_up_least_recently_used():
    checkpoints = StateCheckpoints(range(5, 7))
    assert (checkpoints.take(b"a"), checkpoints.take(b"b"), checkpoints.take(b"a")) == (5, 6, None)
    assert checkpoints.lookup(b"a") == 5  # now b is the least recently used
    assert checkpoints.take(b"c") == 6 and checkpoints.lookup(b"b") is None
    assert dict(checkpoints.slots) == {b"a": 5, b"c": 6}


def test_a_hit_resumes_only_where_the_windowed_pages_it_reads_are_held():
    """A windowed group (reach 2) evicted the pages of a prefix's first columns; the checkpoint at
    2 pages would need column 1 there, so the hit falls back to none, and the first chunk stops at
    the 4 pages still held (8 tokens) to checkpoint the states there."""
    pages = KVCacheManager(
        (None, 2), [10, 6], page_size=2, prefix_caching=True, checkpoints=StateCheckpoints(range(1, 3))
    )
    window = pages.groups[1]
    first = Sequence(None, list(range(1, 10)), SamplingParams(), seed=0)
    pages.allocate(first, 9)  # 5 pages in each group: the window's pool has no more
    first.num_cached = 8
    pages.register(first)
    pages.checkpoints.take(first.page_hashes[1])
    pages.allocate(first, 9)  # rows from 8 on read columns 3 and 4: the window gives up 0-2
    pages.free(first)
    window.allocate(BlockTable(), 6)  # its free page, then the window's columns 0 and 1 evicted
    again = Sequence(None, list(range(1, 10)), SamplingParams(), seed=0)
    assert pages.match_prefix(again) == 0 and again.checkpoint_position == 8
