"""Speculative sampling has exactly the target's distribution: the joint distribution of the
first three generated tokens, sampled through the engine (drafts accepted and rejected),
passes a chi-square test against the exact target distribution, and the same test rejects
a deliberately wrong acceptance rule."""

import itertools
import random

import pytest
import torch
from conftest import make_drafter, make_target
from transformers import AutoModelForCausalLM

from blockspec import LLM, SamplingParams
from blockspec.engine import speculative
from blockspec.sampling import rejection_sample, sample, token_probs

VOCAB, PROMPT, N = 6, [1, 4, 3], 3000
CASES = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=4, top_p=0.9, min_p=0.2)]


def exact_distribution(path, params: SamplingParams, prompt: list[int] = PROMPT) -> dict[tuple, float]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    dist = {}
    with torch.no_grad():
        for prefix in itertools.product(range(VOCAB), repeat=2):
            logits = model(torch.tensor([prompt + list(prefix)])).logits[0]
            p = token_probs(logits, params)
            first, second = p[len(prompt) - 1, prefix[0]], p[len(prompt), prefix[1]]
            for t in range(VOCAB):
                dist[prefix + (t,)] = float(first * second * p[-1, t])
    return dist


def chi_square_pvalue(counts: dict, expected: dict, n: int) -> float:
    big = [k for k, p in expected.items() if p * n >= 5]
    obs = [counts.get(k, 0) for k in big] + [n - sum(counts.get(k, 0) for k in big)]
    exp = [expected[k] * n for k in big] + [n * (1 - sum(expected[k] for k in big))]
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp) if e > 0)
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def sampled_counts(llm: LLM, params: SamplingParams, prompt: list[int] = PROMPT) -> tuple[dict, list[int]]:
    fields = {**params.__dict__, "max_tokens": 3, "ignore_eos": True}
    outs = llm.generate([prompt] * N, [SamplingParams(**{**fields, "seed": i}) for i in range(N)])
    counts = {}
    for o in outs:
        key = tuple(o.outputs[0].token_ids)
        counts[key] = counts.get(key, 0) + 1
    return counts, [a for o in outs for a in o.metrics.acceptance_lengths]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampling")
    t = make_target(root / "t", "llama", vocab=VOCAB, seed=3)
    return t, make_drafter(root / "d", t, block_size=4, seed=5)


@pytest.mark.parametrize("params", CASES, ids=["T1", "T0.8-topk4-topp0.9-minp0.2"])
def test_speculative_sampling_matches_target_distribution(pair, params):
    t, d = pair
    llm = LLM(
        str(t), {"model": str(d), "num_speculative_tokens": 2, "adaptive_width": False}, device="cpu", max_num_seqs=512
    )
    counts, steps = sampled_counts(llm, params)
    assert {1, 2, 3} <= set(steps)  # drafts were rejected at once, later, and all accepted: every path ran
    assert chi_square_pvalue(counts, exact_distribution(t, params), N) > 1e-3


def test_ngram_sampling_matches_target_distribution(pair):
    t, _ = pair
    llm = LLM(
        str(t),
        {"method": "ngram", "num_speculative_tokens": 2, "adaptive_width": False},
        device="cpu",
        max_num_seqs=512,
    )
    prompt = [1, 4, 3, 5, 1, 4, 3, 5, 1, 4]  # repeats: the lookup proposes [3, 5]
    counts, steps = sampled_counts(llm, CASES[0], prompt)
    assert {1, 3} <= set(steps)  # point-mass drafts were rejected and accepted
    assert chi_square_pvalue(counts, exact_distribution(t, CASES[0], prompt), N) > 1e-3


def test_mixed_block_widths_keep_the_target_distribution(pair, monkeypatch):
    """Adaptive width narrows blocks from step to step; here every sequence of every step gets a
    random width of its own (1 to the full block): still exactly the target's distribution."""
    t, d = pair
    llm = LLM(str(t), {"model": str(d), "num_speculative_tokens": 2}, device="cpu", max_num_seqs=512)
    engine, rng = llm.engine, random.Random(0)
    monkeypatch.setattr(engine, "step_widths", lambda seqs, full: ([rng.randint(1, f) for f in full], None))
    counts, steps = sampled_counts(llm, CASES[0])
    assert {1, 2, 3} <= set(steps)
    assert chi_square_pvalue(counts, exact_distribution(t, CASES[0]), N) > 1e-3


def wrong_rejection_sample(drafts, p, q, generator):
    """The classic mistake: after a rejection, sample from p instead of max(p - q, 0)."""
    rows = torch.arange(len(drafts))
    u = torch.rand(len(drafts), generator=generator)
    accepted = (u * q[rows, drafts] < p[rows, drafts]).int().cumprod(0).sum()
    return accepted, sample(p[accepted][None], generator)[0]


def test_wrong_acceptance_rule_is_detected(pair, monkeypatch):
    monkeypatch.setattr(speculative, "rejection_sample", wrong_rejection_sample)
    t, d = pair
    llm = LLM(
        str(t), {"model": str(d), "num_speculative_tokens": 2, "adaptive_width": False}, device="cpu", max_num_seqs=512
    )
    counts, _ = sampled_counts(llm, CASES[0])
    assert chi_square_pvalue(counts, exact_distribution(t, CASES[0]), N) < 1e-6


def test_token_probs_top_k_top_p_min_p():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    p = token_probs(logits, SamplingParams(temperature=1.0, top_k=3))
    torch.testing.assert_close(p, torch.tensor([4 / 9, 3 / 9, 2 / 9, 0]))
    p = token_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))  # smallest set with mass >= 0.7
    torch.testing.assert_close(p, torch.tensor([4 / 7, 3 / 7, 0, 0]))
    p = token_probs(logits, SamplingParams(temperature=1.0, min_p=0.45))  # >= 0.45 x the top one
    torch.testing.assert_close(p, torch.tensor([4 / 9, 3 / 9, 2 / 9, 0]))
    p = token_probs(logits, SamplingParams(temperature=1.0, top_p=0.75, min_p=0.45))  # min_p after top_p
    torch.testing.assert_close(p, torch.tensor([4 / 9, 3 / 9, 2 / 9, 0]))  # before: [4 / 7, 3 / 7, 0, 0]


def test_tiny_temperatures_tend_to_greedy():
    """T -> 0 is the argmax's point mass, also where logits / T would overflow fp32."""
    logits = torch.tensor([[3.0, 5.0, -2.0, 4.9], [1e4, -1e4, 0.0, 9e3]])
    for t in (1e-3, 1e-30, 1e-40, 1e-45):
        probs = token_probs(logits, SamplingParams(temperature=t, top_p=0.9, top_k=3))
        assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 4).float()), t


def test_seeded_sampling_is_reproducible(pair):
    t, d = pair
    llm = LLM(str(t), {"model": str(d)}, device="cpu")
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=7, ignore_eos=True)
    a = llm.generate([PROMPT], params)[0].outputs[0].token_ids
    b = llm.generate([PROMPT, [2, 2], [3]], params)[0].outputs[0].token_ids
    other = llm.generate([PROMPT], SamplingParams(temperature=1.0, max_tokens=12, seed=8, ignore_eos=True))[0]
    assert a == b and other.outputs[0].token_ids != a  # the seed, not greedy decoding, fixed it


def test_sample_draws_what_multinomial_draws() -> None:
    """`sample` is torch.multinomial(probs, 1) without its device-waiting check: the same tokens
    and the same generator state after, for every seed; zero-probability tokens are never drawn."""
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(4, 1000) * 3, -1)
    probs[:, :500] = 0  # a top-k/top-p cut
    probs = probs / probs.sum(-1, keepdim=True)
    for seed in range(100):
        ours, theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        tokens = sample(probs, ours)
        assert torch.equal(tokens, torch.multinomial(probs, 1, generator=theirs)[:, 0])
        assert torch.equal(ours.get_state(), theirs.get_state()) and bool((tokens >= 500).all())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sampling_never_waits_for_the_device() -> None:
    """A step may read the device once; sampling and rejection sampling queue work only."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    p = torch.softmax(torch.randn(5, 1000, device="cuda"), -1)
    q = torch.softmax(torch.randn(4, 1000, device="cuda"), -1)
    drafts = torch.randint(0, 1000, (4,), device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        sample(p, gen)
        rejection_sample(drafts, p, q, gen)
    finally:
        torch.cuda.set_sync_debug_mode("default")
