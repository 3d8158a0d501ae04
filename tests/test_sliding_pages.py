"""Cache groups: sliding layers (the target's and the drafter's) and a drafter context window keep
only the pages their window reads; outputs do not change, and the windowed pools stay bounded."""

from types import SimpleNamespace

import pytest
import torch
from conftest import make_drafter, make_target
from transformers import AutoModelForCausalLM

from blockspec import LLM, SamplingParams
from blockspec.engine.kv_cache_manager import CacheLayout, KVCacheManager
from blockspec.engine.runner import ModelRunner
from blockspec.engine.sequence import Sequence

PAGE = 4
SLIDING = {"layer_types": ["sliding_attention", "full_attention"], "use_sliding_window": True, "sliding_window": 5}


def new_seq(n: int) -> Sequence:
    return Sequence(None, list(range(3, 3 + n)), SamplingParams(), seed=0)


def test_a_windowed_group_releases_the_pages_its_window_left():
    """A full group holds every page; a group of reach 5 takes its pages as the positions come
    and releases those wholly before num_cached - 5, which the tables then show as the trash page."""
    pages = KVCacheManager((None, 5), [20, 10], PAGE, prefix_caching=False)
    full, window = pages.groups
    seq = new_seq(40)
    pages.allocate(seq, 39 + PAGE, window_tokens=0)  # admission: the whole prompt in the full group only
    assert len(seq.block_tables[0].pages) == 11 and seq.block_tables[1].pages == []
    pages.allocate(seq, 16)  # a first prefill chunk
    assert seq.block_tables[1].first == 0 and len(seq.block_tables[1].pages) == 4
    seq.num_cached = 16
    assert pages.pages_needed(seq, 32) == [0, 2]  # 4 new pages, less the 2 before column (16 - 5) // 4
    pages.allocate(seq, 32)
    table = seq.block_tables[1]
    assert (table.first, table.end) == (2, 8) and window.num_free == 9 - 6
    host = ModelRunner.host_block_tables(SimpleNamespace(layout=CacheLayout((None, 5), {}, {})), [seq])
    assert host.shape == (1, 2, 11) and host[0, 1, :2].tolist() == [0, 0] and host[0, 1, 2:8].tolist() == table.pages
    assert host[0, 1, 8:].tolist() == [0, 0, 0] and host[0, 0].tolist() == seq.block_tables[0].pages
    pages.free(seq)
    assert pages.free_pages() == [full.num_usable, window.num_usable]


def test_a_prefix_hit_needs_the_pages_a_window_reads():
    """A cached prefix of k pages hits where every windowed group still holds the pages its reach
    reads before position k * page_size; with one of them evicted, the hit shrinks to where it does."""
    pages = KVCacheManager((None, 3), [8, 8], page_size=2, prefix_caching=True)
    window = pages.groups[1]
    seq = new_seq(13)  # 6 whole pages before the anchor
    pages.allocate(seq, 13)
    seq.num_cached = 12
    pages.register(seq)
    col5 = seq.block_tables[1].pages[5]
    pages.free(seq)  # the tail first: column 5's page is the cache's oldest, column 6's unregistered one free
    assert [window.take() for _ in range(2)][1] == col5  # the free page, then column 5's evicted
    again = new_seq(13)
    assert pages.match_prefix(again) == 10  # rows after 5 pages read positions 7-9: still held
    assert (again.block_tables[1].first, len(again.block_tables[1].pages)) == (3, 2)
    assert len(again.block_tables[0].pages) == 5
    pages.free(again)
    window.drop(col5)  # back, unregistered: a whole hit needs it computed again
    assert pages.match_prefix(new_seq(13)) == 10


def sliding_pair(tmp_path, window: int | None = None):
    """A gpt-oss target (sliding layers of window 8 and full ones) and a drafter with a sliding
    layer of window 5 and a full one."""
    t = make_target(tmp_path / "t", "gpt_oss", layers=4)
    d = make_drafter(tmp_path / "d", t, block_size=6, target_layer_ids=[1, 3], **SLIDING)
    spec = {"model": str(d), "window": window} if window is not None else {"model": str(d)}
    return t, spec


@pytest.mark.parametrize("window", [None, 6])
def test_windowed_pools_change_no_output_and_stay_bounded(tmp_path, window):
    """Prompts several windows long, prefilled in chunks: plain and speculative greedy decoding
    equal transformers' generate while the windowed groups release pages; no sequence ever holds
    more of a windowed pool than its reach and two steps' positions (and a chunk) span."""
    t, spec = sliding_pair(tmp_path, window)
    llm = LLM(str(t), spec, device="cpu", page_size=PAGE, max_num_batched_tokens=16)
    layout = llm.engine.layout
    drafter_reaches = {"full_attention": window, "sliding_attention": 4}
    assert layout.reaches == tuple(sorted({None, 7, *drafter_reaches.values()}, key=lambda r: r or -1))
    assert [layout.reaches[g] for g in (layout.target["sliding_attention"], layout.drafter["sliding_attention"])] == [
        7,
        4,
    ]
    assert layout.reaches[layout.drafter["full_attention"]] == window
    peaks, released, step = {}, set(), llm.engine.step

    def watched():
        for seq in llm.engine.scheduler.running:
            for g, table in enumerate(seq.block_tables):
                peaks[g] = max(peaks.get(g, 0), len(table.pages))
                released.add(g) if table.first else None
        return step()

    llm.engine.step = watched
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 120, (n,), generator=gen).tolist() for n in (37, 50)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    plain = LLM(str(t), None, device="cpu", page_size=PAGE, max_num_batched_tokens=16)
    assert [o.outputs[0].token_ids for o in plain.generate(prompts, params)] == outs
    hf = AutoModelForCausalLM.from_pretrained(t, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs):
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None)
        assert out == expected[0, len(prompt) :].tolist()
    windowed = [g for g, r in enumerate(layout.reaches) if r is not None]
    assert released == set(windowed)
    span = 6  # the drafter's block
    for g in windowed:
        bound = -(-(layout.reaches[g] + 2 * span + 16) // PAGE) + 1
        assert 0 < peaks[g] <= bound < peaks[0]
    pages = llm.engine.scheduler.kv_cache_manager
    assert pages.free_pages() == [g.num_usable for g in pages.groups]


def test_prefix_cache_hits_with_sliding_layers(tmp_path):
    """A repeated long prompt skips its prefill with windowed groups too, with the same output."""
    t, spec = sliding_pair(tmp_path)
    llm = LLM(str(t), spec, device="cpu", page_size=PAGE, prefix_caching=True, max_num_batched_tokens=16)
    prompt = list(range(3, 50))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first = llm.generate([prompt], params)[0].outputs[0].token_ids
    prefilled, prefill = [], llm.engine.runner.prefill
    llm.engine.runner.prefill = lambda seqs, counts: (prefilled.append(counts), prefill(seqs, counts))
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == first
    assert prefilled == [[46 - 11 * PAGE]]  # 11 whole pages hit, in every group
    cold = LLM(str(t), spec, device="cpu", page_size=PAGE, max_num_batched_tokens=16)
    assert cold.generate([prompt], params)[0].outputs[0].token_ids == first


def test_windowed_pool_sizes(tmp_path):
    """num_pages sizes the full group; each windowed group gets its bound: the trash page, per
    sequence its reach and two steps' positions (the drafter's block of 6) plus a page, and one
    step's prefill chunks (8192 tokens)."""
    t, spec = sliding_pair(tmp_path)
    llm = LLM(str(t), spec, device="cpu", page_size=PAGE, num_pages=300, max_num_seqs=4)
    assert llm.engine.layout.reaches == (None, 4, 7)
    usable = [g.num_usable + 1 for g in llm.engine.scheduler.kv_cache_manager.groups]
    chunks = 8192 // PAGE
    assert usable == [300, 1 + 4 * (4 + 1 + 1) + chunks, 1 + 4 * (5 + 1 + 1) + chunks]  # ceil((reach + 12) / 4)
    k_cache = llm.engine.runner.target_cache[0][0]  # layer 0 slides (gpt-oss alternates, sliding first)
    assert k_cache.shape[0] == usable[llm.engine.layout.target["sliding_attention"]] * PAGE
