"""Deferred drafter context: a width-1 step of the adaptive engine keeps its row's target features
in the sequence's ring instead of committing them to the drafter's context; the next step that
drafts (or a width-1 step that finds a ring full) commits them all first. The drafter's cache then
holds what per-step commits write, greedy output stays the target's, pages are shared only once
their drafter context is written, and a preempted sequence starts with nothing deferred."""

import itertools
from pathlib import Path

import pytest
import torch
from conftest import add_word_tokenizer, make_dflash2, make_drafter, make_dspark, make_target

from blockspec import LLM, SamplingParams
from blockspec.config import SpeculativeConfig
from blockspec.structured_output import StructuredOutput, xgrammar_installed

# forced widths: runs of width-1 steps shorter and longer than a ring of 3, between drafting steps
WIDTHS = (1, 1, 4, 1, 1, 1, 1, 1, 2, 8, 1, 1, 1, 1, 1, 1, 1, 4)
PROMPTS = [[5, 9, 11], list(range(20, 45)), [7] * 6]
PARAMS = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return str(make_target(tmp_path_factory.mktemp("deferred") / "t", "qwen3", vocab=128))


@pytest.fixture(scope="module", params=[make_drafter, make_dspark, make_dflash2], ids=["dflash", "dspark", "dflash2"])
def drafters(request, target) -> tuple[str, str]:
    """The target with a drafter of each kind (all commit their context as DFlash does)."""
    return target, str(request.param(Path(target).parent / request.param.__name__, Path(target)))


@pytest.fixture(scope="module")
def pair(target) -> tuple[str, str]:
    return target, str(make_drafter(Path(target).parent / "d", Path(target), block_size=8))


def engine(pair, deferred: int, **options) -> LLM:
    """A CPU engine whose adaptive policy runs the forced widths, in turn."""
    t, d = pair
    llm = LLM(t, {"model": d, "deferred_context": deferred}, device="cpu", page_size=4, **options)
    widths = itertools.cycle(WIDTHS)
    llm.engine.adaptive.choose = lambda batch, limit, rows: next(widths)
    return llm


def record_commits(llm: LLM) -> list[int]:
    """The rows of each drafter context commit (a prefill's, a step's, a flush's)."""
    proposer = llm.engine.proposer
    rows, commit = [], type(proposer).commit

    def counted(runner, features, starts, counts, block_tables):
        rows.append(features.shape[1])
        commit(proposer, runner, features, starts, counts, block_tables)

    proposer.commit = counted
    return rows


def drafter_cache(llm: LLM) -> list[torch.Tensor]:
    """The drafter's K/V pools, the trash page left out (padding rows write there)."""
    return [pool[1:].clone() for cache in llm.engine.runner.drafter_cache for pool in cache]


@pytest.mark.parametrize("async_steps", [False, True])
def test_deferred_context_is_the_context_per_step_commits_write(drafters, async_steps) -> None:
    deferred, direct = engine(drafters, 3, async_steps=async_steps), engine(drafters, 0, async_steps=async_steps)
    assert deferred.engine.runner.deferred.shape[:2] == (deferred.engine.num_slots, 3)
    assert direct.engine.runner.deferred is None
    rows = {"deferred": record_commits(deferred), "direct": record_commits(direct)}
    for llm in (deferred, direct):
        for p in PROMPTS:
            llm.engine.add_request(p, PARAMS)
    compared = 0
    while deferred.engine.has_unfinished():
        done = [s.num_cached for s in deferred.engine.step()]
        assert [s.num_cached for s in direct.engine.step()] == done  # the same widths, the same tokens
        running = deferred.engine.scheduler.running
        assert all(s.num_deferred <= 3 + async_steps for s in running)
        # (a CPU step launched ahead has run already: the cache holds what it wrote)
        if running and not any(s.num_deferred for s in running):
            for a, b in zip(drafter_cache(deferred), drafter_cache(direct)):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            compared += 1
    assert compared >= 3
    # a width-1 step commits no drafter context (one row); flushes commit a ring's 3 rows
    assert 1 not in rows["deferred"] and 3 in rows["deferred"] and 1 in rows["direct"]
    assert len(rows["deferred"]) < len(rows["direct"])


@pytest.mark.parametrize("async_steps", [False, True])
def test_deferred_context_keeps_greedy_output_exact(pair, async_steps) -> None:
    plain = LLM(pair[0], None, device="cpu").generate(PROMPTS, PARAMS)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, return_drafts=True)
    out = engine(pair, 3, async_steps=async_steps).generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
    assert {1, 4, 8} <= {len(d) + 1 for o in out for d in o.metrics.draft_token_ids}


def test_drafts_are_those_of_per_step_commits(tmp_path) -> None:
    """The drafter drafts from the same context whether it was deferred or not: the same drafts
    every step, in a batch with a request that follows a grammar (its drafts proposed before the
    step, after the flush) where xgrammar is installed."""
    t = add_word_tokenizer(make_target(tmp_path / "t", "qwen3", vocab=128), 128)
    pair = str(t), str(make_drafter(tmp_path / "d", t, block_size=8))
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, return_drafts=True)] * len(PROMPTS)
    if xgrammar_installed():
        regex = StructuredOutput(regex="(w5|w6|w7)+")
        params[1] = SamplingParams(temperature=0, max_tokens=40, structured_output=regex, return_drafts=True)
    runs = [engine(pair, k).generate(PROMPTS, params) for k in (3, 0)]
    deferred, direct = ([(o.outputs[0].token_ids, o.metrics.draft_token_ids) for o in out] for out in runs)
    assert deferred == direct
    assert all(any(drafts) for _, drafts in deferred)  # every request drafted, the grammar's among them
    if xgrammar_installed():  # the grammar was in force: its request's tokens are w5-w7, then eos (w2)
        assert set(deferred[1][0]) <= {2, 5, 6, 7}


def test_pages_are_shared_once_their_drafter_context_is_written(pair) -> None:
    llm = engine(pair, 3)
    llm.engine.add_request(list(range(20, 45)), PARAMS)
    page, deferring, caught_up = 4, 0, 0
    while llm.engine.has_unfinished():
        llm.engine.step()
        for s in llm.engine.scheduler.running:
            registered = len(s.page_hashes) * page
            assert registered <= s.num_cached - s.num_deferred
            deferring += (s.num_cached // page) * page > s.num_cached - s.num_deferred
            caught_up += s.num_deferred == 0 and registered == (s.num_cached // page) * page
    assert deferring and caught_up


def test_a_preempted_sequence_starts_with_nothing_deferred(pair) -> None:
    """A pool too small for both sequences: the newer is preempted (its ring's positions are
    prefilled again), and outputs stay the target's."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [list(range(20, 45)), list(range(50, 75))]
    plain = LLM(pair[0], None, device="cpu").generate(prompts, params)
    llm = engine(pair, 3, num_pages=24, max_model_len=80)  # one sequence fits, two do not
    preempt, seen = llm.engine.scheduler.preempt, []
    llm.engine.scheduler.preempt = lambda seq: (
        seen.append(seq.num_deferred),
        preempt(seq),
        seen.append(seq.num_deferred),
    )
    out = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
    assert seen and seen[1::2] == [0] * (len(seen) // 2)


def test_deferred_context_is_validated() -> None:
    with pytest.raises(ValueError, match="deferred_context must be >= 0"):
        SpeculativeConfig(deferred_context=-1)
    for needs in ({"adaptive_width": False}, {"method": "ngram"}):
        with pytest.raises(ValueError, match="needs both"):
            SpeculativeConfig(deferred_context=8, **needs)
