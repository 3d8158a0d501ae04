"""Speculative sampling has exactly the target's distribution: the joint distribution of the
first three generated tokens, sampled through the engine (drafts accepted and rejected),
passes a chi-square test against the exact target distribution, and the same test rejects
a deliberately wrong acceptance rule."""

import itertools
import random
from dataclasses import replace

import pytest
import torch
from conftest import make_drafter, make_target
from transformers import AutoModelForCausalLM

from blockspec import LLM, SamplingParams, sampling
from blockspec.engine import step
from blockspec.engine.step import accept
from blockspec.proposers.base import Proposal, draft_from_logits, proposal_q
from blockspec.proposers.simulated import geometric_counts
from blockspec.sampling import (
    DRAW_CHUNK,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    SAMPLING_COLUMNS,
    InvalidSamplingParam,
    Stream,
    acceptance_chances,
    argmax,
    draw,
    min_p_filter,
    probs,
    residual_tokens,
    sampled_accept,
    sampling_row,
    tempered_scores,
    token_probs,
    uniform,
)

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


def wrong_residual_tokens(accepted, p, q, num_drafts, u, drafts=None):
    """The classic mistake: after a rejection, sample from p instead of max(p - q, 0)."""
    return draw(p.gather(1, accepted[:, None, None].expand(-1, 1, p.shape[-1]))[:, 0], u)


def test_wrong_acceptance_rule_is_detected(pair, monkeypatch):
    monkeypatch.setattr(sampling, "residual_tokens", wrong_residual_tokens)  # unfiltered rows' (`sample_block`)
    monkeypatch.setattr(step, "residual_tokens", wrong_residual_tokens)
    t, d = pair
    llm = LLM(
        str(t), {"model": str(d), "num_speculative_tokens": 2, "adaptive_width": False}, device="cpu", max_num_seqs=512
    )
    counts, _ = sampled_counts(llm, CASES[0])
    assert chi_square_pvalue(counts, exact_distribution(t, CASES[0]), N) < 1e-6


def test_greedy_and_sampled_rows_share_a_step(pair):
    """A batch of greedy and sampled requests runs one step for all: the greedy ones give plain
    greedy decoding's tokens, the seeded sampled ones what they give alone."""
    t, d = pair
    llm = LLM(str(t), {"model": str(d), "num_speculative_tokens": 2, "adaptive_width": False}, device="cpu")
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, top_k=5, max_tokens=10, ignore_eos=True, seed=3)
    plain = LLM(str(t), None, device="cpu").generate([PROMPT], greedy)[0].outputs[0].token_ids
    alone = llm.generate([PROMPT], sampled)[0].outputs[0].token_ids
    mixed = llm.generate([PROMPT, PROMPT, [2, 5]], [greedy, sampled, greedy])
    assert mixed[0].outputs[0].token_ids == plain and mixed[1].outputs[0].token_ids == alone


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_argmax_off_the_kernel_is_torchs_first_maximum(dtype):
    """`argmax` where no kernel serves it (the CPU) takes `max`'s indices: torch's argmax exactly,
    the first of tied maxima (bf16's rounding makes many), rows of -inf, inf and NaN, strided rows."""
    torch.manual_seed(0)
    x = torch.randn(4, 16, 4099).mul(4).round().to(dtype)  # whole numbers: ties in every row
    x[0, 0] = float("-inf")
    x[0, 1, [5, 900]] = float("inf")
    x[0, 2, [7, 3000]] = float("nan")
    x[1, 3] = 2.0
    for view in (x, x[:, ::3, 10:4000], x[0, 0]):
        assert torch.equal(argmax(view), view.argmax(dim=-1))
    assert argmax(x)[0, :3].tolist() == [0, 5, 7] and argmax(x)[1, 3] == 0


def test_tiny_temperatures_tend_to_greedy():
    """T -> 0 is the argmax's point mass, also where logits / T would overflow fp32."""
    logits = torch.tensor([[3.0, 5.0, -2.0, 4.9], [1e4, -1e4, 0.0, 9e3]])
    for t in (1e-3, 1e-30, 1e-40, 1e-45):
        probs = token_probs(logits, SamplingParams(temperature=t, top_p=0.9, top_k=3))
        assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 4).float()), t


def test_a_min_p_only_request_keeps_its_filter(pair):
    """min_p alone makes a step "filtered": at min_p 1 only the top token survives, so T=1 sampling
    with drafts and without them is greedy decoding (it would sample freely if min_p were dropped)."""
    t, d = pair
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    top_only = SamplingParams(temperature=1.0, min_p=1.0, max_tokens=12, seed=3, ignore_eos=True)
    for spec in ({"model": str(d)}, None):
        llm = LLM(str(t), spec, device="cpu")
        assert llm.generate([PROMPT], top_only)[0].outputs[0].token_ids == (
            llm.generate([PROMPT], greedy)[0].outputs[0].token_ids
        )
    free = SamplingParams(temperature=1.0, max_tokens=12, seed=3, ignore_eos=True)
    assert (
        llm.generate([PROMPT], free)[0].outputs[0].token_ids != llm.generate([PROMPT], greedy)[0].outputs[0].token_ids
    )


def test_seeded_sampling_is_reproducible(pair):
    t, d = pair
    llm = LLM(str(t), {"model": str(d)}, device="cpu")
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=7, ignore_eos=True)
    a = llm.generate([PROMPT], params)[0].outputs[0].token_ids
    b = llm.generate([PROMPT, [2, 2], [3]], params)[0].outputs[0].token_ids
    other = llm.generate([PROMPT], SamplingParams(temperature=1.0, max_tokens=12, seed=8, ignore_eos=True))[0]
    assert a == b and other.outputs[0].token_ids != a  # the seed, not greedy decoding, fixed it


def test_probs_without_filters_equals_probs_where_no_row_filters():
    """Top-k, top-p and min-p (the sort, min-p's passes) are skipped where no row asks for them: the
    same distributions; each of the three makes a request `filtered`."""
    logits = torch.randn(3, 5, 50)
    rows = torch.tensor([sampling_row(SamplingParams(temperature=t)) for t in (0.7, 1.3, 0)])
    assert rows.shape[-1] == len(SAMPLING_COLUMNS)
    torch.testing.assert_close(probs(logits, rows[:, None], False), probs(logits, rows[:, None], True))
    assert not SamplingParams(temperature=0.7).filtered
    assert all(SamplingParams(temperature=0.7, **f).filtered for f in ({"top_k": 5}, {"top_p": 0.9}, {"min_p": 0.1}))


def test_uniforms_are_uniform_and_independent_across_positions_seeds_and_streams():
    """Counter-based uniforms: a function of (seed, position, stream), reproducible; pairs of them
    (the next position, another stream, a neighbouring seed) fill a 10 x 10 grid evenly
    (chi-square), and their 53 bits cover [0, 1)."""
    seeds = torch.arange(4000) * 1_000_003 % 2**63
    positions = torch.arange(4000) % 97 + 5
    u = uniform(seeds, positions, Stream.DRAFT)
    assert torch.equal(u, uniform(seeds, positions, Stream.DRAFT)) and u.dtype == torch.float64
    assert 0 <= u.min() and u.max() < 1 and (u * 2**53 % 2 == 1).any()  # low bits are random too
    for other in (
        uniform(seeds, positions + 1, Stream.DRAFT),
        uniform(seeds, positions, Stream.ACCEPT),
        uniform(seeds + 1, positions, Stream.DRAFT),
    ):
        cells = (u * 10).long() * 10 + (other * 10).long()
        counts = torch.bincount(cells, minlength=100).double()
        stat = float(((counts - 40) ** 2 / 40).sum())
        assert float(torch.special.gammaincc(torch.tensor(99 / 2, dtype=torch.float64), torch.tensor(stat / 2))) > 1e-4


def test_draw_is_the_inverse_cdf():
    """`draw` takes the first token whose cumulative mass exceeds u x total: unnormalized rows work,
    zero-mass tokens are never drawn, and uniform u reproduce the distribution."""
    p = torch.tensor([[0.0, 2.0, 0.0, 6.0, 2.0]])
    for u, token in ((0.0, 1), (0.2 - 1e-12, 1), (0.2, 3), (0.8, 4), (1 - 2**-53, 4)):
        assert draw(p, torch.tensor([u], dtype=torch.float64)).tolist() == [token], u
    u = uniform(torch.arange(20000), torch.zeros(20000, dtype=torch.long), Stream.RESIDUAL)
    tokens = draw(p.expand(20000, -1), u)
    assert torch.bincount(tokens, minlength=5).tolist()[0::2] == [0, 0, tokens.eq(4).sum()]
    assert abs(tokens.eq(3).double().mean() - 0.6) < 0.02


def test_draw_over_chunks_is_the_inverse_cdf_of_the_whole_row():
    """`draw`'s two-level CDF picks the token a single scan along the row would: rows longer than a
    chunk and not a multiple of it, whole chunks of zero mass, u at 0 and just below 1."""
    gen = torch.Generator().manual_seed(0)
    vocab = 3 * DRAW_CHUNK + 77
    p = torch.rand(64, vocab, generator=gen) ** 8
    p[::2, DRAW_CHUNK : 2 * DRAW_CHUNK] = 0  # a chunk without mass
    p[1::4, 3 * DRAW_CHUNK :] = 0  # the last (short) chunk without mass
    u = torch.rand(64, generator=gen, dtype=torch.float64)
    u[:4] = torch.tensor([0.0, 1 - 2**-53, 0.5, 1 - 2**-53], dtype=torch.float64)
    cdf = p.cumsum(-1, dtype=torch.float64)
    whole = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    tokens = draw(p, u)
    assert (p.gather(1, tokens[:, None]) > 0).all()
    # float64 sums in another order: only a u * total within rounding of a boundary could move a token
    assert torch.equal(tokens[4:], whole[4:])
    positive = [row.nonzero()[:, 0] for row in p[:4]]
    assert tokens[:4].tolist() == [positive[0][0], positive[1][-1], whole[2], positive[3][-1]]
    # u * total on the first chunk's cdf, where the mass before chunk 1 taken as cdf - mass rounds
    # above it: the draw is still chunk 1's token of mass
    p = torch.zeros(2 * DRAW_CHUNK, dtype=torch.float64)
    p[0], p[1], p[DRAW_CHUNK + 1] = 1, 2**-52, 2**-53
    u = torch.tensor([(1 + 2**-52) / (1 + 2**-51)], dtype=torch.float64)
    assert draw(p[None], u).tolist() == [DRAW_CHUNK + 1]


def test_accept_mixes_greedy_and_sampled_rows():
    """`accept` on a batch of one greedy and one sampled row: the greedy row's counts and bonus are
    the prefix match's, whatever the sampled row does."""
    logits = torch.randn(2, 4, 9)
    drafts = logits.argmax(-1)[:, :3]
    drafts[0, 2] = (drafts[0, 2] + 1) % 9  # the greedy row's third draft is wrong
    rows = torch.tensor([sampling_row(SamplingParams(temperature=0)), sampling_row(SamplingParams(temperature=1))])
    inputs = step.StepInputs(
        torch.cat([drafts[:, :1], drafts], 1), torch.tensor([3, 3]), torch.tensor([4, 4]), torch.zeros(2, 1, dtype=torch.long),
        torch.tensor([1, 2]), torch.zeros(2, dtype=torch.long), torch.from_numpy(rows.float().numpy().view("int64")),
    )  # fmt: skip
    result = accept(Proposal(drafts, torch.softmax(logits[:, :3], -1)), logits, inputs)
    accepted, bonus = result.accepted, result.bonus
    assert accepted[0] == 2 and bonus[0] == logits[0, 2].argmax()
    assert 0 <= accepted[1] <= 3


@pytest.mark.parametrize("filters", [False, True])
def test_a_plain_steps_token_is_the_residual_draw_after_no_drafts(filters):
    """A width-1 step (no drafts) draws each sampled row's token as a step with drafts would after
    accepting none of them: from the row's distribution at its uniform of position start + 1 in the
    RESIDUAL stream; greedy rows take the argmax. With filters (top-k), the general rule runs."""
    logits = torch.randn(64, 1, 50) * 2
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7)]
    if filters:
        params.append(SamplingParams(temperature=1.0, top_k=5))
    rows = torch.tensor([sampling_row(params[i % len(params)]) for i in range(64)])
    starts, seeds = torch.randint(0, 1000, (64,)), torch.randint(0, 2**62, (64,))
    inputs = step.StepInputs(
        torch.zeros(64, 1, dtype=torch.long), starts, torch.ones(64, dtype=torch.long),
        torch.zeros(64, 1, dtype=torch.long), seeds, torch.zeros(64, dtype=torch.long),
        torch.from_numpy(rows.float().numpy().view("int64")), filters=filters,
    )  # fmt: skip
    result = accept(Proposal(torch.zeros(64, 0, dtype=torch.long), None), logits, inputs)
    accepted, tokens = result.accepted, result.bonus
    u = uniform(seeds, starts + 1, Stream.RESIDUAL)
    expected = draw(probs(logits, rows[:, None], filters)[:, 0], u)
    greedy = rows[:, 0] == 0
    expected[greedy] = logits[greedy, 0].argmax(-1)
    assert accepted.tolist() == [0] * 64 and torch.equal(tokens, expected)
    assert not torch.equal(
        draw(probs(logits, rows[:, None], filters)[:, 0], uniform(seeds, starts, Stream.RESIDUAL)), expected
    )


@pytest.mark.parametrize("filters", [False, True])
def test_drafts_and_their_q_written_out_or_left_to_the_step(filters):
    """A drafter's sampled drafts are draws from its distribution q at their DRAFT uniforms (greedy
    rows the argmax); unfiltered, the proposal keeps the drafter's logits too (`draft_logits`, what
    CUDA's kernels read, never writing q out). The step accepts and draws alike from q written out,
    from the logits alone, or from both; `proposal_q` writes q out where the proposal holds none."""
    B, w, V = 48, 4, 40
    draft_logits, logits = torch.randn(B, w - 1, V) * 2, torch.randn(B, w, V) * 2
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7), SamplingParams(temperature=1.0)]
    if filters:
        params.append(SamplingParams(temperature=1.0, top_k=5))
    rows = torch.tensor([sampling_row(params[i % len(params)]) for i in range(B)])
    starts, seeds = torch.randint(0, 1000, (B,)), torch.randint(0, 2**62, (B,))
    inputs = step.StepInputs(
        torch.zeros(B, w, dtype=torch.long), starts, torch.full((B,), w), torch.zeros(B, 1, dtype=torch.long), seeds,
        torch.zeros(B, dtype=torch.long), torch.from_numpy(rows.float().numpy().view("int64")), filters=filters,
    )  # fmt: skip
    proposal = draft_from_logits(draft_logits, inputs)
    q = probs(draft_logits, rows[:, None], filters)
    expected = draw(q, uniform(seeds[:, None], inputs.draft_positions, Stream.DRAFT))
    greedy = rows[:, 0] == 0
    expected[greedy] = draft_logits[greedy].argmax(-1)
    assert torch.equal(proposal.drafts, expected)
    assert torch.equal(proposal.q, q) and (proposal.draft_logits is draft_logits) == (not filters)
    for form in [proposal] + [replace(proposal, q=None)] * (not filters):
        assert torch.equal(proposal_q(form, inputs), q)
    ruled = accept(replace(proposal, draft_logits=None), logits, inputs).accepted  # q written out: the general rule
    assert 0 < ruled[~greedy].float().mean() < w - 1  # drafts accepted and rejected
    # with the rule's counts, and with a simulated proposal's imposed ones (the token after them)
    for imposed in (None, torch.randint(0, w, (B,))):
        base = replace(proposal, accepted=imposed)
        expected = accept(replace(base, draft_logits=None), logits, inputs)
        for form in [base] + [replace(base, q=None)] * (not filters):
            result = accept(form, logits, inputs)
            assert torch.equal(result.accepted, expected.accepted) and torch.equal(result.bonus, expected.bonus)


def test_accept_keeps_nothing_past_a_cut():
    """A proposer's cut (`Proposal.num_drafts`) bounds what is accepted, by the rule and by a
    simulated proposal's imposed counts alike; the token after a cut block is the target's own."""
    logits = torch.randn(2, 4, 9)
    drafts = logits.argmax(-1)[:, :3]  # every draft the target's choice
    inputs = step.StepInputs(
        torch.cat([drafts[:, :1], drafts], 1), torch.tensor([3, 3]), torch.tensor([4, 4]),
        torch.zeros(2, 1, dtype=torch.long), torch.tensor([1, 2]), torch.zeros(2, dtype=torch.long),
    )  # fmt: skip
    cut = torch.tensor([1, 3])
    for imposed in (None, torch.tensor([3, 2])):
        result = accept(Proposal(drafts, accepted=imposed, num_drafts=cut), logits, inputs)
        accepted, bonus = result.accepted, result.bonus
        expected = [1, 3] if imposed is None else [1, 2]
        assert accepted.tolist() == expected and bonus.tolist() == [
            int(logits[i, a].argmax()) for i, a in enumerate(expected)
        ]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sampling_never_waits_for_the_device() -> None:
    """A step may read the device once; the draws and the acceptance queue work only."""
    logits = torch.randn(2, 5, 1000, device="cuda")
    drafts = torch.randint(0, 1000, (2, 4), device="cuda")
    rows = torch.tensor([sampling_row(SamplingParams(temperature=0.7, top_p=0.9))] * 2).numpy().view("int64")
    inputs = step.StepInputs(
        torch.cat([drafts[:, :1], drafts], 1), torch.tensor([3, 9], device="cuda"), torch.tensor([5, 5], device="cuda"),
        torch.zeros(2, 1, dtype=torch.long, device="cuda"), torch.tensor([1, 2], device="cuda"),
        torch.zeros(2, dtype=torch.long, device="cuda"), torch.from_numpy(rows).cuda(), filters=True,
    )  # fmt: skip
    torch.cuda.set_sync_debug_mode("error")
    try:
        accept(Proposal(drafts, torch.softmax(logits[:, :4], -1)), logits, inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.no_grad()
def test_sampling_ops_agree_on_cuda_and_cpu() -> None:
    """The draws are bit for bit the same on CUDA and on the CPU: the same request samples the same
    tokens on either device; the compiled tempered distributions agree with their eager definitions
    within fp32 rounding."""
    seeds = torch.randint(0, 2**62, (7, 1), device="cuda")
    positions = torch.arange(5, device="cuda") + torch.randint(0, 10**6, (7, 1), device="cuda")
    for stream in Stream:
        assert torch.equal(uniform(seeds, positions, stream).cpu(), uniform(seeds.cpu(), positions.cpu(), stream))
    drafts = torch.full((7,), 15, device="cuda")
    counts = geometric_counts(seeds[:, 0], positions[:, 0], drafts, -0.13)
    assert torch.equal(counts.cpu(), geometric_counts(seeds[:, 0].cpu(), positions[:, 0].cpu(), drafts.cpu(), -0.13))
    logits = torch.randn(7, 5, 151936, device="cuda", dtype=torch.bfloat16) * 4
    t, m = torch.rand(7, 1, 1, device="cuda"), torch.rand(7, 1, 1, device="cuda") * 0.1
    torch.testing.assert_close(tempered_scores(logits, t), tempered_scores.eager(logits, t))
    p = torch.softmax(tempered_scores(logits, t), -1)
    torch.testing.assert_close(min_p_filter(p, m), min_p_filter.eager(p, m))


def test_stop_strings_are_bounded_in_count_and_length():
    SamplingParams(stop=["x" * MAX_STOP_CHARS] * MAX_STOP_STRINGS)  # at both limits
    for stop in (["x"] * (MAX_STOP_STRINGS + 1), ["x" * (MAX_STOP_CHARS + 1)]):
        with pytest.raises(InvalidSamplingParam) as e:
            SamplingParams(stop=stop)
        assert e.value.param == "stop"
        assert str(e.value) == "stop must be at most 64 non-empty strings of at most 1024 characters"


def test_a_drafts_chance_is_the_frequency_of_its_acceptance():
    """`acceptance_chances`: sum min(p, q) is the probability that a draft drawn from q passes the
    rule u * q(d) < p(d). Over 200,000 draws of one row the acceptances' frequency lies within 4
    standard errors of it; a plausible wrong chance (the mean of min(1, p / q) over the vocabulary,
    unweighted by q) does not."""
    gen = torch.Generator().manual_seed(5)
    p, q = (
        torch.softmax(2 * torch.randn(1, 2, 12, generator=gen), -1),
        torch.softmax(torch.randn(1, 1, 12, generator=gen), -1),
    )
    n = 200_000
    drafts = draw(q[0].expand(n, -1), torch.rand(n, generator=gen, dtype=torch.float64))[:, None]
    u = torch.rand(n, 1, generator=gen, dtype=torch.float64)
    frequency = sampled_accept(drafts, p.expand(n, -1, -1), q.expand(n, -1, -1), torch.ones(n, dtype=torch.long), u)
    chance = float(acceptance_chances(p, q, torch.ones(1, dtype=torch.long))[0, 0])
    error = (chance * (1 - chance) / n) ** 0.5
    assert abs(float(frequency.double().mean()) - chance) < 4 * error
    wrong = float((p[0, 0] / q[0, 0]).clamp_max(1).mean())
    assert abs(float(frequency.double().mean()) - wrong) > 4 * error


def test_point_masses_are_read_at_the_drafts_as_one_hot_rows_would_be():
    """q None (an n-gram proposer's certain drafts) gives the accepted counts, residual tokens and
    chances that explicit one-hot rows at the drafts give, without the [B, S-1, V] tensor; the
    residual never draws the rejected draft."""
    gen = torch.Generator().manual_seed(3)
    batch, rows, vocab = 64, 4, 6
    p = torch.softmax(2 * torch.randn(batch, rows + 1, vocab, generator=gen), -1)
    drafts = torch.randint(0, vocab, (batch, rows), generator=gen)
    num_drafts = torch.randint(0, rows + 1, (batch,), generator=gen)
    one_hot = torch.nn.functional.one_hot(drafts, vocab).float()
    u = torch.rand(batch, rows, generator=gen, dtype=torch.float64)
    accepted = sampled_accept(drafts, p, None, num_drafts, u)
    assert torch.equal(accepted, sampled_accept(drafts, p, one_hot, num_drafts, u))
    assert 0 < int((accepted < num_drafts).sum()) < batch
    u_residual = torch.rand(batch, generator=gen, dtype=torch.float64)
    token = residual_tokens(accepted, p, None, num_drafts, u_residual, drafts)
    assert torch.equal(token, residual_tokens(accepted, p, one_hot, num_drafts, u_residual))
    rejected = accepted < num_drafts
    assert not (token[rejected] == drafts[rejected].gather(1, accepted[rejected, None])[:, 0]).any()
    chances = acceptance_chances(p, None, num_drafts, drafts)
    assert torch.allclose(chances, acceptance_chances(p, one_hot, num_drafts), atol=1e-7)


@pytest.mark.parametrize("filters", [False, True])
def test_a_step_reports_each_reached_drafts_chance(filters):
    """`accept(..., chances=True)`: a sampled row's chances are sum min(p, q) of its drafts reached
    (the accepted ones and the first rejected), 0 past them; a greedy row's and a simulated
    proposal's are the outcomes (1 accepted, 0 not); the counts and tokens are those without chances."""
    B, w, V = 48, 5, 40
    gen = torch.Generator().manual_seed(3)
    draft_logits, logits = torch.randn(B, w - 1, V, generator=gen), torch.randn(B, w, V, generator=gen)
    logits[:, : w - 1] += draft_logits  # drafts accepted often enough to reach far rows
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7), SamplingParams(temperature=1.0)]
    if filters:
        params.append(SamplingParams(temperature=1.0, top_k=5))
    rows = torch.tensor([sampling_row(params[i % len(params)]) for i in range(B)])
    inputs = step.StepInputs(
        torch.zeros(B, w, dtype=torch.long), torch.randint(0, 1000, (B,), generator=gen), torch.full((B,), w),
        torch.zeros(B, 1, dtype=torch.long), torch.randint(0, 2**62, (B,), generator=gen),
        torch.zeros(B, dtype=torch.long), torch.from_numpy(rows.float().numpy().view("int64")), filters=filters,
    )  # fmt: skip
    proposal = draft_from_logits(draft_logits, inputs)
    plain, result = accept(proposal, logits, inputs), accept(proposal, logits, inputs, chances=True)
    assert plain.chances is None
    assert torch.equal(plain.accepted, result.accepted) and torch.equal(plain.bonus, result.bonus)
    cols = torch.arange(w - 1)
    outcomes = (cols < result.accepted[:, None]).float()
    reached = cols <= result.accepted[:, None]
    p = probs(logits, rows[:, None], filters)
    expected = torch.minimum(p[:, :-1], proposal_q(proposal, inputs)).sum(-1) * reached
    greedy = rows[:, 0] == 0
    assert torch.equal(result.chances[greedy], outcomes[greedy])
    assert torch.allclose(result.chances[~greedy], expected[~greedy], atol=1e-6)
    assert (result.chances[~greedy] * reached[~greedy]).gt(0).any() and (result.accepted[~greedy] > 1).any()
    imposed = torch.randint(0, w, (B,), generator=gen)
    simulated = accept(replace(proposal, accepted=imposed), logits, inputs, chances=True)
    assert torch.equal(simulated.chances, (cols < imposed[:, None]).float())
