"""Log-probabilities of output tokens: the target's own distribution of each committed token (its
raw logits' log softmax), the same whether a token was verified as a draft or decoded alone, and
equal to transformers' model on the whole sequence."""

import pytest
import torch
from conftest import make_drafter, make_target
from test_cuda_graphs import CpuGraphCache
from transformers import AutoModelForCausalLM

from blockspec import LLM, SamplingParams
from blockspec.outputs import TokenLogprob

PROMPTS = [[5, 9, 31], list(range(20, 45)), [7] * 3]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("logprobs")
    target = make_target(root / "t", "qwen3", vocab=128)
    return target, make_drafter(root / "d", target, block_size=6)


def params(k: int | None = 3) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.8 if i % 2 else 0, seed=i, max_tokens=14, ignore_eos=True, logprobs=k)
        for i in range(len(PROMPTS))
    ]


def assert_same(a: list[TokenLogprob], b: list[TokenLogprob]) -> None:
    assert [x.token_id for x in a] == [y.token_id for y in b]
    assert [x.logprob for x in a] == pytest.approx([y.logprob for y in b], abs=1e-5)
    assert [list(x.top) for x in a] == [list(y.top) for y in b]
    top = [[v for x in side for v in x.top.values()] for side in (a, b)]
    assert top[0] == pytest.approx(top[1], abs=1e-5)


def test_speculative_logprobs_equal_plain_decodings_and_transformers(pair):
    """Greedy: the same tokens and log-probabilities as plain decoding. Greedy and sampled: each
    committed token's, and the top 3, as transformers computes them over the whole sequence."""
    target, drafter = pair
    spec = LLM(str(target), {"model": str(drafter), "adaptive_width": False}, "cpu").generate(PROMPTS, params())
    plain = LLM(str(target), None, "cpu").generate(PROMPTS, params())
    assert any(n > 1 for o in spec for n in o.metrics.acceptance_lengths)  # drafts were accepted
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    for s, p, sp, prompt in zip(spec, plain, params(), PROMPTS):
        out = s.outputs[0]
        assert len(out.logprobs) == len(out.token_ids)
        if sp.greedy:  # a sampled request's tokens depend on the drafts (only their distribution does not)
            assert out.token_ids == p.outputs[0].token_ids
            assert_same(out.logprobs, p.outputs[0].logprobs)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1]
        logp = torch.log_softmax(logits, -1)
        expected = [
            TokenLogprob(t, logp[i, t].item(), dict(zip(*(v.tolist() for v in reversed(logp[i].topk(3))))))
            for i, t in enumerate(out.token_ids)
        ]
        assert_same(out.logprobs, expected)
        for lp in out.logprobs:  # the committed token is at most as likely as the top one
            assert lp.logprob <= max(lp.top.values()) + 1e-6


def test_logprobs_in_graph_replays_and_mixed_batches(pair):
    """A batch where one request asks for logprobs and others do not, through the graph cache's
    row classes (the +logprobs graphs), equals eager decoding; no logprobs where none were asked,
    and top 0 reports the token's alone."""
    target, drafter = pair
    asked = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=k) for k in (None, 0, 5)]
    eager = LLM(str(target), {"model": str(drafter)}, "cpu").generate(PROMPTS, asked)
    graphed = LLM(str(target), {"model": str(drafter)}, "cpu", async_steps=True)
    engine = graphed.engine
    engine.runner.graphs = CpuGraphCache(8, -(-engine.max_model_len // 16), engine.adaptive.classes)
    outs = graphed.generate(PROMPTS, asked)
    assert eager[0].outputs[0].logprobs is None and outs[0].outputs[0].logprobs is None
    assert [len(lp.top) for lp in outs[1].outputs[0].logprobs] == [0] * 14
    for a, b in zip(eager[1:], outs[1:]):
        assert_same(a.outputs[0].logprobs, b.outputs[0].logprobs)
    assert any(name.endswith("+logprobs") for name, *_ in engine.runner.graphs.graphs)


def test_a_stop_cuts_the_logprobs_with_the_tokens(pair):
    target, _ = pair
    llm = LLM(str(target), None, "cpu")
    full = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))[0]
    stop = full.outputs[0].token_ids[5]
    sp = SamplingParams(temperature=0, max_tokens=14, stop_token_ids=[stop], logprobs=1)
    out = llm.generate(PROMPTS[:1], sp)[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == out.token_ids.index(stop) + 1


def test_prompt_logprobs_equal_transformers_whatever_the_prefill(pair):
    """prompt_logprobs: each prompt token after the first, given the tokens before it, with the top k,
    as transformers' log softmax; the same prefilled whole, in chunks of 5 rows, after the prompt's
    pages were cached (it is prefilled again: no hit), and with speculation."""
    target, drafter = pair
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    prompt = list(range(20, 57))
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, :-1], -1)
    expected = [
        TokenLogprob(t, float(logp[i, t]), {int(j): float(logp[i, j]) for j in logp[i].topk(4).indices})
        for i, t in enumerate(prompt[1:])
    ]
    asked = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=4)
    for llm in (
        LLM(str(target), None, device="cpu", page_size=4, prefix_caching=True),
        LLM(str(target), {"model": str(drafter)}, device="cpu", page_size=4, max_num_batched_tokens=5),
    ):
        for _ in range(2):  # the second time, the prompt's pages are cached (where the cache is on)
            out = llm.generate([prompt], asked)[0]
            assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
            assert_same(out.prompt_logprobs[1:], expected)
        assert llm.generate([prompt], SamplingParams(max_tokens=2))[0].prompt_logprobs is None


def test_prompt_logprobs_of_a_preempted_sequence_are_reported_once(pair):
    """A preempted sequence's recomputed prefill adds no prompt log-probabilities: a small pool that
    preempts reports what a large one does."""
    target, drafter = pair
    prompts = [list(range(3 + i, 20 + i)) for i in range(6)]
    asked = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, prompt_logprobs=2)
    small = LLM(str(target), {"model": str(drafter)}, device="cpu", page_size=4, num_pages=15, max_model_len=48)
    outs = small.generate(prompts, asked)
    assert small.engine.scheduler.num_preemptions > 0
    large = LLM(str(target), {"model": str(drafter)}, device="cpu", page_size=4, max_model_len=48)
    for a, b in zip(outs, large.generate(prompts, asked)):
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == 17
        assert_same(a.prompt_logprobs[1:], b.prompt_logprobs[1:])
