"""The CUDA-graph bookkeeping (buckets, padding to the row class, static buffers, trimming
of outputs), run on the CPU with a stand-in graph that replays by calling the captured
function on its static buffers: outputs must equal the eager engine's."""

import argparse

import numpy as np
import pytest
from conftest import add_word_tokenizer, count_launches_ahead, make_dflash2, make_drafter, make_dspark, make_target
from test_hybrid_targets import hybrid_target

from blockspec import LLM, SamplingParams
from blockspec.cli import add_engine_args, build_llm
from blockspec.engine.cuda_graphs import GraphCache
from blockspec.engine.warm_up import step_kinds, warm_up
from blockspec.structured_output import StructuredOutput, xgrammar_installed


class ReplayByCall:
    def __init__(self, fn, static, out) -> None:
        self.fn, self.static, self.out = fn, static, out

    def replay(self) -> None:
        for out, new in zip(self.out, self.fn(self.static)):
            if out is not None:
                out.copy_(new)


class CpuGraphCache(GraphCache):
    def capture(self, fn, bucket, width, inputs, pool):
        static = self.static_inputs(bucket, width, inputs)
        out = fn(static)
        return ReplayByCall(fn, static, out), static, out


@pytest.mark.parametrize("async_steps", [False, True], ids=["lock-step", "launched-ahead"])
def test_graph_bookkeeping_matches_eager(tmp_path, async_steps):
    """Launched ahead, a step replays the graphs while the results of the step before, computed
    from the same static buffers, are still to be read: they must not alias them."""
    t = make_target(tmp_path / "t", "qwen3", vocab=128)
    d = make_drafter(tmp_path / "d", t, block_size=8)
    prompts = [[5, 9], list(range(20, 45)), [7] * 3, [(i * 37) % 120 for i in range(40)], [3]]
    params = [
        SamplingParams(
            temperature=0 if i % 2 else 0.8, seed=i, max_tokens=9 + 5 * i + 30 * (i % 2 == 0), ignore_eos=True
        )
        for i in range(len(prompts))
    ]  # max_tokens not multiples of the width: narrower last steps; the seeded samples (full widths, to
    # stay reproducible, so no launch ahead of their last steps) the longest
    for spec in ({"model": str(d)}, {"method": "ngram", "num_speculative_tokens": 5}, None):
        eager = LLM(str(t), spec, device="cpu", page_size=4)
        graphed = LLM(str(t), spec, device="cpu", page_size=4, async_steps=async_steps)
        launched = count_launches_ahead(graphed)
        runner = graphed.engine.runner
        runner.graphs = CpuGraphCache(8, -(-graphed.engine.max_model_len // 4), (2, 4, graphed.engine.max_width))
        a = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
        b = [o.outputs[0].token_ids for o in graphed.generate(prompts, params)]
        assert a == b
        assert any(launched) == (async_steps and (spec is None or "method" not in spec))  # n-gram: never
        assert {k[1] for k in runner.graphs.graphs} >= {8, 4}  # batches shrank across buckets as requests ended
        if spec is not None:  # narrow last steps ran in the narrow row classes
            assert {k[2] for k in runner.graphs.graphs} >= {2, 4, graphed.engine.max_width}


@pytest.mark.parametrize("async_steps", [False, True], ids=["lock-step", "launched-ahead"])
def test_a_step_replays_one_graph_greedy_sampled_or_mixed(tmp_path, async_steps):
    """Every step is one forward, so one graph a step, named by what its rows need: "greedy", or
    "sampled" / "filtered" (top-k, top-p or min-p) once a row samples, greedy rows riding along; the same
    tokens as eager, with the drafter and in plain decoding; launched ahead, each step reads the step
    before's outputs from that graph."""
    t = make_target(tmp_path / "t", "qwen3", vocab=128)
    d = make_drafter(tmp_path / "d", t, block_size=8)
    prompts = [[5, 9], list(range(20, 45)), [7] * 3]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    cases = {
        "greedy": [greedy] * 3,
        "sampled": [greedy, SamplingParams(temperature=0.9, seed=1, max_tokens=12, ignore_eos=True), greedy],
        "filtered": [
            SamplingParams(temperature=0.9, top_p=0.8, seed=i, max_tokens=12, ignore_eos=True) for i in range(3)
        ],
    }
    for spec in ({"model": str(d), "adaptive_width": False}, None):
        for mode, params in cases.items():
            eager = LLM(str(t), spec, device="cpu", page_size=4).generate(prompts, params)
            graphed = LLM(str(t), spec, device="cpu", page_size=4, async_steps=async_steps)
            runner = graphed.engine.runner
            runner.graphs = CpuGraphCache(8, -(-graphed.engine.max_model_len // 4), (graphed.engine.max_width,))
            replays = count_replays(runner.graphs)
            outs = graphed.generate(prompts, params)
            assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in eager]
            names = {k[0] for k in runner.graphs.graphs}  # greedy once the sampled rows finished
            assert mode in names and names <= {"greedy", mode}
            steps = max(len(o.metrics.acceptance_lengths) for o in outs)
            assert steps <= len(replays) <= steps + 1  # one a step (and one left in flight, launched ahead)


def count_replays(graphs: GraphCache) -> list[str]:
    """The names of the graphs replayed, in order."""
    names, run = [], graphs.run

    def counted(name, fn, inputs, **options):
        names.append(name)
        return run(name, fn, inputs, **options)

    graphs.run = counted
    return names


def test_host_arrays_cross_in_one_copy_as_aligned_views(tmp_path):
    """`ModelRunner.tensors`: each array comes back with its values and shape, as a view of one
    buffer starting at an even int64 offset (16 bytes: the alignment kernels specialize on) of 2
    or more (torch.compile specializes offsets 0 and 1), odd and empty arrays included."""
    runner = LLM(str(make_target(tmp_path / "t", "qwen3", vocab=128)), device="cpu").engine.runner
    arrays = [[3, 1, 4], np.arange(6).reshape(2, 3), [], [[9]], [2, 7]]
    views = runner.tensors(*arrays)
    for view, a in zip(views, arrays, strict=True):
        assert view.tolist() == np.asarray(a).tolist() and view.shape == np.shape(a)
        assert view.storage_offset() % 2 == 0 and view.storage_offset() >= 2
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1


@pytest.mark.parametrize(
    "family,drafter",
    [("qwen3", make_drafter), ("gpt_oss", make_drafter), ("qwen3_5", make_drafter), ("qwen3", make_dspark),
     ("qwen3", make_dflash2)],
)  # fmt: skip
def test_warm_up_captures_every_step_graph_serving_needs(tmp_path, family, drafter):
    """`engine.warm_up` captures a graph of every step kind at every bucket and row class, writing only
    where padding does (the trash page, the trash state slot): requests of every kind, penalized
    and structured ones among them (where xgrammar is installed), then capture nothing, and their
    outputs equal an eager engine's."""
    grammar = xgrammar_installed()
    t = hybrid_target(tmp_path, family) if family == "qwen3_5" else make_target(tmp_path / "t", family, vocab=128)
    add_word_tokenizer(t, 128)
    d = drafter(tmp_path / "d", t)
    spec = {"model": str(d), "deferred_context": 4}
    eager = LLM(str(t), spec, device="cpu", page_size=4, max_num_seqs=4)
    graphed = LLM(str(t), spec, device="cpu", page_size=4, max_num_seqs=4)
    engine = graphed.engine
    runner = engine.runner
    runner.graphs = CpuGraphCache(4, -(-engine.max_model_len // 4), engine.adaptive.classes)
    warm_up(runner, 4, engine.config.max_num_batched_tokens, engine.step_rows, engine.num_slots, grammar)
    names = {k[0] for k in runner.graphs.graphs}
    plain = {
        n
        for n in names
        if "grammar" not in n and "defer" not in n and n.split("+")[0] in ("greedy", "sampled", "filtered")
    }
    assert len(plain) == len(step_kinds()) == 12
    wide = [w for w in engine.adaptive.classes if w > 1]
    assert {(m, b, w) for m in plain for b in (1, 2, 4) for w in wide} <= set(runner.graphs.graphs)
    # width-1 steps defer the drafter's context (`StepInputs.backlog`), and a flush commits it
    deferring = {(m + "+defer", b, 1) for m in plain for b in (1, 2, 4)} | {("flush", b, 1) for b in (1, 2, 4)}
    assert deferring <= set(runner.graphs.graphs)
    captured = len(runner.graphs.graphs)
    prompts = [[5, 9], list(range(20, 45)), [7] * 3, [(i * 37) % 120 for i in range(40)]]
    kinds = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=1, max_tokens=12, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.8, top_p=0.9, seed=2, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, min_tokens=4, logprobs=1),
        SamplingParams(temperature=0.8, seed=3, max_tokens=12, repetition_penalty=1.3, presence_penalty=0.5),
    ]
    if grammar:
        assert {"greedy+grammar", "sampled+grammar+q", "propose+sampled"} <= {k[0] for k in runner.graphs.graphs}
        regex = StructuredOutput(regex="(w5|w6|w7)(w8|w9)(w5|w6|w7)")
        kinds += [
            SamplingParams(temperature=0, max_tokens=12, structured_output=regex),
            SamplingParams(temperature=0.8, top_k=5, seed=4, max_tokens=12, structured_output=regex, logprobs=1),
        ]
    # a batch's kind joins its requests' options (without xgrammar, two kinds in turn)
    mixed = [kinds[3 + i % (len(kinds) - 3)] for i in range(len(prompts))]
    for params in [*kinds, mixed]:
        a = [o.outputs[0] for o in eager.generate(prompts, params)]
        b = [o.outputs[0] for o in graphed.generate(prompts, params)]
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert len(runner.graphs.graphs) == captured  # nothing captured at request time


@pytest.mark.parametrize(
    "kv_heads,group,fused,page_size,sms",
    [(2, 2, True, 4, 16), (3, 3, True, 16, 132), (8, 4, True, 16, 132), (2, 8, False, 16, 132)],
)
def test_prefill_variants_reach_every_attention_variant(kv_heads, group, fused, page_size, sms):
    """Over every prefill of up to 6 sequences, 300 rows and 160 pages: each one's kernel variant is
    among `prefill_variants`', whose shapes lie in that range and launch the variant they stand for."""
    from blockspec.layers.kernels.paged_attention import AttentionHeads, launch_variant, prefill_variants

    max_batch, max_rows, max_pages = 6, 300, 160
    heads = AttentionHeads(kv_heads, group, fused, sms)
    variants = prefill_variants(heads, page_size, max_batch, max_rows, max_pages)
    reached = {
        launch_variant(b, rows, pages * page_size, heads)
        for b in range(1, max_batch + 1)
        for rows in range(1, max_rows + 1)
        for pages in range(-(-rows // page_size), max_pages + 1)
    }
    assert reached == set(variants) and len(reached) > 10
    for key, (b, rows, pages) in variants.items():
        assert b <= max_batch and rows <= max_rows and -(-rows // page_size) <= pages <= max_pages
        assert launch_variant(b, rows, pages * page_size, heads) == key
    assert any(key[0] == "qkv" for key in variants) == fused  # without the fused kernel, no variant of it


@pytest.mark.parametrize("kv_heads,group,sms", [(3, 3, 132), (8, 4, 132), (2, 8, 16), (2, 2, 132)])
def test_invariant_fold_prefill_is_the_least_prefill_that_folds(kv_heads, group, sms):
    """Row invariance's attention has two variants: a launch whose tiles fill the SMs folds each
    tile's splits in its one program, others (the warm-up grid's small prefills) do not. The
    warm-up's prefill for the folded one folds, and is the least (fewest sequences, then rows)
    within the bounds; bounds that no folded prefill fits give none."""
    from blockspec.layers.kernels.paged_attention import AttentionHeads, invariant_fold_prefill, invariant_folds

    heads, max_batch, max_rows = AttentionHeads(kv_heads, group, True, sms), 4, 2048
    b, rows = invariant_fold_prefill(heads, max_batch, max_rows)
    assert invariant_folds(rows * group, b * kv_heads, sms) and b <= max_batch and rows <= max_rows
    assert not invariant_folds((rows - 1) * group, b * kv_heads, sms)
    assert not any(invariant_folds(max_rows * group, fewer * kv_heads, sms) for fewer in range(1, b))
    assert invariant_fold_prefill(heads, 1, rows - 1 if b == 1 else max_rows) is None


def test_warm_up_sees_which_targets_take_the_fused_step_kernel(tmp_path):
    """Whole-head rotary of a power-of-two head dim takes the fused step kernel; Qwen3.5's partial
    rotary does not (its small prefills run the prefill kernel, whose variants warm-up then reaches)."""
    from blockspec.engine.warm_up import attention_heads
    from blockspec.layers.kernels import kernel_module

    kernels = kernel_module("paged_attention")
    if kernels is None:
        pytest.skip("needs triton")
    for target, fused in (
        (make_target(tmp_path / "qwen3", "qwen3", vocab=128), True),
        (hybrid_target(tmp_path, "qwen3_5"), False),  # in tmp_path / "t"
    ):
        runner = LLM(str(target), None, device="cpu").engine.runner
        assert attention_heads(runner, kernels).fused == fused


def test_the_command_line_switches_warm_up(tmp_path):
    """`--warm-up on|off` (on by default) sets EngineConfig.warm_up."""
    t = make_target(tmp_path / "t", "qwen3", vocab=128)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for flags, expected in (([], True), (["--warm-up", "off"], False)):
        args = parser.parse_args(["--model", str(t), "--draft", "none", "--device", "cpu", *flags])
        assert build_llm(args, None).engine.config.warm_up is expected  # --draft none: no drafter
