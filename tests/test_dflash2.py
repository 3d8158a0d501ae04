"""DFlash2 drafters: the block convolution against a direct loop; identity convolutions compute
DFlash; the selector's lattice and walk against a dense reference written here (a zero successor
codebook walks the per-row argmax); greedy speculative decoding equals plain decoding; speculative
sampling with q over the K candidates keeps the target's distribution, also where the target's
likeliest token is not among them, and a q that ignores the walk is caught."""

import json

import pytest
import torch
from conftest import make_dflash2, make_drafter, make_target
from safetensors.torch import load_file, save_file
from test_drafter import dense_block_hidden
from test_errors import rewrite
from test_sampling import CASES, VOCAB, N, chi_square_pvalue, exact_distribution, sampled_counts
from transformers import AutoModelForCausalLM

from blockspec import LLM, SamplingParams
from blockspec.engine.kv_cache import allocate_kv_cache
from blockspec.engine.kv_cache_manager import KVCacheManager
from blockspec.engine.runner import ModelRunner
from blockspec.engine.sequence import Sequence
from blockspec.loading.drafters import load_drafter
from blockspec.loading.hf import load_target
from blockspec.loading.weights import CheckpointError
from blockspec.models.dflash2 import CandidateSelector, block_conv
from blockspec.proposers import dflash2
from blockspec.proposers.dflash2 import DFlash2Proposer

CPU = torch.device("cpu")


@pytest.mark.parametrize("taps", [2, 3])
@pytest.mark.parametrize("rows", [8, 16, 7])
def test_block_conv_matches_a_direct_loop(taps, rows):
    x, kernel = torch.randn(3, rows, 5), torch.randn(3, rows, taps, 5)
    expected = torch.zeros_like(x)
    for b in range(3):
        for i in range(rows):
            for t in range(taps):
                if i - t >= 0:  # never a row before the block's first
                    expected[b, i] += kernel[b, i, t] * x[b, i - t]
    torch.testing.assert_close(block_conv(x, kernel), expected)


def greedy_run(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[list[int]]]]:
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, return_drafts=True)
    return [(o.outputs[0].token_ids, o.metrics.draft_token_ids) for o in llm.generate(prompts, params)]


PROMPTS = [[1, 5, 9, 33, 7], [1, 80, 3, 3, 3, 3, 14, 2, 90], [1, 17]]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("dflash2") / "t", "qwen3")


def test_identity_convolutions_and_no_selector_compute_dflash(tmp_path, target):
    """The same weights with identity convolutions and no selector draft exactly as DFlash."""
    d2 = make_dflash2(tmp_path / "d2", target, identity=True, selector=(0, 0))
    d1 = make_drafter(tmp_path / "d1", target, block_size=6, target_layer_ids=[1, 3])
    weights = load_file(d2 / "model.safetensors")
    save_file({n: t for n, t in weights.items() if "_conv." not in n}, d1 / "model.safetensors")
    spec = {"adaptive_width": False}  # widths from timings would differ
    runs = [greedy_run(LLM(str(target), {"model": str(d), **spec}, device="cpu"), PROMPTS) for d in (d1, d2)]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("taps", [2, 3])
def test_block_forward_with_convolutions_matches_dense_reference(tmp_path, target, taps):
    """Random convolutions, the engine's paged block forward against the dense one: where the
    coefficients come from, which sides wrap which sublayer, rows never reading across blocks."""
    dpath = make_dflash2(tmp_path / "d", target, taps=taps)
    t = load_target(target, torch.float32, CPU).model
    drafter = load_drafter(dpath, t, torch.float32, CPU)
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    runner, w = runner_of(t, drafter), load_file(dpath / "model.safetensors")
    seqs = prefilled(runner, PROMPTS)
    with torch.inference_mode():
        hidden = runner.proposer.draft_hidden(runner, runner.step_inputs(seqs, [6, 6, 6], None, None))
    for i, ids in enumerate(PROMPTS):
        with torch.no_grad():
            hs = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
            feats = torch.cat([hs[j + 1][0, :-1] for j in (1, 3)], dim=-1)
            block = torch.tensor([ids[-1]] + [drafter.mask_token_id] * 5)
            expected = dense_block_hidden(w, 2, feats, hf.model.embed_tokens(block), len(ids) - 1)
        torch.testing.assert_close(hidden[i], expected[1:], atol=1e-4, rtol=1e-4)


def runner_of(t, drafter, page: int = 4) -> ModelRunner:
    return ModelRunner(
        t,
        DFlash2Proposer(drafter),
        allocate_kv_cache(4, 32, page, 2, 16, torch.float32, "cpu"),
        allocate_kv_cache(2, 32, page, 2, 16, torch.float32, "cpu"),
        page,
    )


def prefilled(runner: ModelRunner, prompts: list[list[int]]) -> list[Sequence]:
    pages, seqs = (
        KVCacheManager((None,), [32], runner.page_size, False),
        [Sequence(None, p, SamplingParams(temperature=0), 0) for p in prompts],
    )
    for s in seqs:
        pages.allocate(s, len(s.token_ids) + 6)
    runner.prefill(seqs)
    return seqs


@pytest.mark.parametrize("successor_zero", [True, False])
def test_walk_matches_dense_reference(tmp_path, target, successor_zero):
    """Greedy: row 0's candidates scored against the anchor, each later row's against the
    candidate the row before took; with a zero successor codebook, the per-row argmax."""
    dpath = make_dflash2(tmp_path / "d", target, successor_zero=successor_zero, scale=3.0)
    t = load_target(target, torch.float32, CPU).model
    drafter = load_drafter(dpath, t, torch.float32, CPU)
    runner, w = runner_of(t, drafter), load_file(dpath / "model.safetensors")
    seqs = prefilled(runner, PROMPTS)
    with torch.inference_mode():
        inputs = runner.step_inputs(seqs, [6, 6, 6], None, None)
        hidden = runner.proposer.draft_hidden(runner, inputs)
        logits = drafter.compute_logits(hidden, t)
        drafts = runner.proposer.propose(runner, inputs).drafts
    names = ("predecessor_codebook", "successor_codebook", "hidden_projection.weight")
    pred, succ, proj = (w[f"candidate_selector.{n}"] for n in names)
    for i, prompt in enumerate(PROMPTS):
        prev, expected = prompt[-1], []
        for row in range(5):
            unary, ids = logits[i, row].topk(4)
            scores = unary + ((pred[prev] * (proj @ hidden[i, row])) * succ[ids]).sum(-1)
            prev = int(ids[scores.argmax()])
            expected.append(prev)
        assert drafts[i].tolist() == expected
        if successor_zero:
            assert expected == logits[i].argmax(-1).tolist()


def test_greedy_speculative_equals_plain(tmp_path, target):
    d = make_dflash2(tmp_path / "d", target, taps=3, scale=3.0)
    llm = LLM(str(target), {"model": str(d)}, device="cpu")
    assert llm.engine.drafter.num_drafts == 5
    plain = [o.outputs[0].token_ids for o in LLM(str(target), None, device="cpu").generate(PROMPTS, greedy_params())]
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy_params())] == plain


def greedy_params() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def sampling_target(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("dflash2_sampling") / "t", "llama", vocab=VOCAB, seed=3)


def sampling_llm(target, drafter) -> LLM:
    spec = {"model": str(drafter), "num_speculative_tokens": 2, "adaptive_width": False}
    return LLM(str(target), spec, device="cpu", max_num_seqs=512)


@pytest.mark.parametrize("params", CASES, ids=["T1", "T0.8-topk4-topp0.9-minp0.2"])
def test_speculative_sampling_matches_target_distribution(tmp_path, sampling_target, params):
    """K = 2 of 6 tokens: the target's likeliest token is often outside q's support."""
    d = make_dflash2(tmp_path / "d", sampling_target, block_size=3, selector=(4, 2), scale=2.0, seed=5)
    counts, steps = sampled_counts(sampling_llm(sampling_target, d), params)
    assert {1, 3} <= set(steps)
    assert chi_square_pvalue(counts, exact_distribution(sampling_target, params), N) > 1e-3


def test_q_without_the_pair_scores_is_caught(tmp_path, sampling_target, monkeypatch):
    """Drafts walked along the pair scores but verified against the softmax of the candidates'
    LM-head logits alone (DFlash's q on the same support): no longer the target's distribution."""
    d = make_dflash2(tmp_path / "d", sampling_target, block_size=3, selector=(4, 2), scale=2.0, seed=5)
    lattice, unary = CandidateSelector.lattice, {}

    def recorded(self, logits, hidden, anchors):
        ids, scores = lattice(self, logits, hidden, anchors)
        unary["logits"] = logits.float().gather(-1, ids)
        return ids, scores

    def unary_q(ids, scores, inputs, vocab):
        proposal = walk(ids, scores, inputs, vocab)
        t = inputs.sampling_params[:, 0, None, None]
        q = torch.softmax(unary["logits"] / torch.where(t > 0, t, 1.0), -1)
        proposal.q = torch.zeros_like(proposal.q).scatter_(-1, ids, q)
        return proposal

    walk = dflash2.walk
    monkeypatch.setattr(CandidateSelector, "lattice", recorded)
    monkeypatch.setattr(dflash2, "walk", unary_q)
    counts, _ = sampled_counts(sampling_llm(sampling_target, d), CASES[0])
    assert chi_square_pvalue(counts, exact_distribution(sampling_target, CASES[0]), N) < 1e-6


def test_unsupported_and_malformed_dflash2_configs(tmp_path, target):
    d = make_dflash2(tmp_path / "d", target)
    fields = json.loads((d / "config.json").read_text())["dflash_config"]
    for i, (change, message) in enumerate(
        (
            (
                {"dflash_config": {**fields, "conv_group_size": 0}},
                "conv_kernel_size and conv_group_size are set together",
            ),
            (
                {"dflash_config": {**fields, "conv_kernel_size": 9}},
                r"conv_kernel_size 9 is wider than the block \(6 rows\)",
            ),
            ({"dflash_config": {**fields, "conv_group_size": 24}}, "conv_group_size 24 does not divide hidden_size 64"),
            ({"dflash_config": {**fields, "selector_top_k": 0}}, "selector_rank and selector_top_k are set together"),
            ({"dflash_config": {**fields, "sample_from_anchor": True}}, "sample_from_anchor .* must not be true"),
            (
                {"dflash_config": {**fields, "shift_label": True}},
                r"sample_from_anchor \(shift_label\) must not be true",
            ),
            ({"draft_vocab_size": 64}, "DFlash2 drafts over the target's whole vocabulary"),
            (
                {"dflash_config": {**fields, "causal": True}},
                "dflash_config.causal True without the same is_causal leaves the block's attention open",
            ),
            ({"is_causal": "no"}, "is_causal must be true or false"),
        )
    ):
        bad = rewrite(d, tmp_path / f"bad{i}", change)
        with pytest.raises(CheckpointError, match=message):
            LLM(str(target), {"model": str(bad)}, device="cpu")
