"""DSpark drafters: the block forward, Markov chain and confidence head against a dense reference
written here from the definition; greedy speculative decoding equals plain decoding in every
dialect (a reduced draft vocabulary too); speculative sampling keeps the target's distribution
(with the confidence cut and a reduced vocabulary), and a proposal distribution without the Markov
correction is caught; each mismatched checkpoint gets its own error."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import make_dspark, make_target
from safetensors.torch import load_file, save_file
from test_drafter import dense_block_hidden
from test_errors import rewrite
from test_sampling import CASES, VOCAB, N, chi_square_pvalue, exact_distribution, sampled_counts
from transformers import AutoModelForCausalLM

from blockspec import LLM, SamplingParams
from blockspec.engine.adaptive import AdaptiveWidth
from blockspec.engine.kv_cache import allocate_kv_cache
from blockspec.engine.kv_cache_manager import KVCacheManager
from blockspec.engine.runner import ModelRunner
from blockspec.engine.sequence import Sequence
from blockspec.engine.step import LaunchedStep, StepOutcome, finish_step
from blockspec.loading.drafters import load_drafter
from blockspec.loading.hf import load_target
from blockspec.loading.weights import CheckpointError
from blockspec.models.dialects import dialect_of
from blockspec.proposers import dspark as dspark_proposer
from blockspec.proposers.dspark import DSparkProposer
from blockspec.sampling import probs

CPU = torch.device("cpu")


def dense_markov_bias(w: dict, head: str, prev: torch.Tensor, h: torch.Tensor, state):
    """The Markov head of one row (DeepSpec's definition): (bias, markov_w1[prev], state)."""
    e = w["markov_head.markov_w1.weight"][prev]
    if head == "vanilla":
        latent = e
    elif head == "gated":
        gate = torch.cat([h, e]) @ w["markov_head.gate_proj.weight"].T + w["markov_head.gate_proj.bias"]
        latent = torch.sigmoid(gate) * e
    else:
        z = torch.cat([state, e, h]) @ w["markov_head.joint_proj.weight"].T + w["markov_head.joint_proj.bias"]
        g, c, o = z.chunk(3)
        state = torch.sigmoid(g) * state + (1 - torch.sigmoid(g)) * torch.tanh(c)
        latent = torch.tanh(o)
    return latent @ w["markov_head.markov_w2.weight"].T, e, state


@pytest.mark.parametrize(
    "head,draft_vocab,shifted",
    [("vanilla", None, True), ("gated", None, True), ("rnn", None, True), ("vanilla", 40, True), ("rnn", None, False)],
)
def test_block_chain_and_confidence_match_dense_reference(tmp_path, head, draft_vocab, shifted):
    tpath = make_target(tmp_path / "t", "qwen3", layers=4)
    dpath = make_dspark(
        tmp_path / "d", tpath, block_size=5, head=head, draft_vocab=draft_vocab, markov_scale=4.0, shifted=shifted
    )
    target = load_target(tpath, torch.float32, CPU).model
    drafter = load_drafter(dpath, target, torch.float32, CPU)
    hf = AutoModelForCausalLM.from_pretrained(tpath, dtype=torch.float32)
    w = load_file(dpath / "model.safetensors")
    page = 4
    runner = ModelRunner(
        target,
        DSparkProposer(drafter),
        allocate_kv_cache(4, 32, page, 2, 16, torch.float32, "cpu"),
        allocate_kv_cache(2, 32, page, 2, 16, torch.float32, "cpu"),
        page,
    )
    pages = KVCacheManager((None,), [32], page, False)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 127, (n,), generator=gen).tolist() for n in (11, 5)]
    widths = [6, 3] if shifted else [5, 3]  # shifted: the 5 rows make 5 drafts, a step verifies up to 6 rows
    seqs = [Sequence(None, p, SamplingParams(temperature=0), 0) for p in prompts]
    for s in seqs:
        pages.allocate(s, len(s.token_ids) + 6)
    runner.prefill(seqs)
    proposer = runner.proposer
    with torch.inference_mode():
        inputs = runner.step_inputs(seqs, widths, None, None)
        hidden = proposer.draft_hidden(runner, inputs)
        proposal, embeddings = proposer.markov_chain(runner, inputs, hidden, drafter.draft_logits(hidden, target))
        confidence = drafter.confidence_logits(hidden, embeddings)
    lm_head = w["lm_head.weight"] if draft_vocab else hf.lm_head.weight
    ids = drafter.draft_to_target if draft_vocab else torch.arange(128)
    for i, (prompt, width) in enumerate(zip(prompts, widths)):
        with torch.no_grad():
            hs = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
            feats = torch.cat([hs[j + 1][0, :-1] for j in (1, 3)], dim=-1)
            block = torch.tensor([prompt[-1]] + [drafter.mask_token_id] * 4)
            rows = dense_block_hidden(w, 2, feats, hf.model.embed_tokens(block), len(prompt) - 1)
            prev, state, drafts, conf = prompt[-1], torch.zeros(8), [], []
            for j in range(width - 1):  # draft j: position s+j+1, after the token drafted before it
                row = rows[j if shifted else j + 1]  # filled rows: row 0 is the anchor's
                bias, e, state = dense_markov_bias(w, head, torch.tensor(prev), row, state)
                prev = int(ids[(row @ lm_head.T + bias).argmax()])
                drafts.append(prev)
                conf.append(torch.cat([row, e]) @ w["confidence_head.proj.weight"][0] + w["confidence_head.proj.bias"])
        assert proposal.drafts[i, : width - 1].tolist() == drafts
        torch.testing.assert_close(confidence[i, : width - 1], torch.cat(conf), atol=1e-4, rtol=1e-4)


def greedy(llm: LLM, prompts: list[list[int]], n: int = 24) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


PROMPTS = [[1, 5, 9, 33, 7], [1, 80, 3, 3, 3, 3, 14, 2, 90], [1, 17]]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("dspark") / "t", "qwen3")


@pytest.mark.parametrize(
    "dialect,kwargs,spec",
    [
        ("deepspec", {}, {}),
        ("deepspec", {"markov_rank": 0, "confidence": False}, {}),  # DeepSeek's DFlash drafters
        ("deepspec", {"head": "rnn"}, {"confidence_threshold": 0.5}),
        ("deepspec", {"shifted": False}, {}),
        ("specforge", {"head": "gated"}, {}),
        ("speculators", {"draft_vocab": 48}, {}),
        ("speculators-dflash", {"markov_rank": 0, "confidence": False, "draft_vocab": 48}, {}),
    ],
    ids=[
        "deepspec",
        "deepspec-dflash",
        "rnn-confidence-cut",
        "filled-rows",
        "specforge",
        "speculators-d2t",
        "speculators-dflash",
    ],
)
def test_greedy_speculative_equals_plain(tmp_path, target, dialect, kwargs, spec):
    d = make_dspark(tmp_path / "d", target, dialect, block_size=6, markov_scale=4.0, **kwargs)
    plain = greedy(LLM(str(target), None, device="cpu"), PROMPTS)
    llm = LLM(str(target), {"model": str(d), **spec}, device="cpu")
    drafter = llm.engine.drafter
    filled = dialect == "speculators-dflash" or not kwargs.get("shifted", True)
    drafts = 5 if filled else 6  # shifted rows (DSpark, DeepSpec's DFlash): one per row
    assert drafter.num_drafts == drafts and llm.engine.max_width == drafts + 1
    assert greedy(llm, PROMPTS) == plain
    if "draft_vocab" in kwargs:  # the target's tokens the drafter cannot propose come from the target
        vocab = set(drafter.draft_to_target.tolist())
        assert any(t not in vocab for out in plain for t in out)


def test_confidences_reach_the_width_policy_as_the_proposer_made_them(tmp_path, target, monkeypatch):
    """Each step's confidences cross to the host beside its drafts (fixed point) and reach the
    adaptive width policy, which sets them beside the drafts accepted; output stays the target's."""
    d = make_dspark(tmp_path / "d", target, block_size=6, markov_scale=4.0)
    llm = LLM(str(target), {"model": str(d)}, device="cpu", warm_up=False)  # its first steps time every width
    made, seen = [], []
    propose, observe = DSparkProposer.propose, AdaptiveWidth.observe

    def recording_propose(self, runner, inputs):
        proposal = propose(self, runner, inputs)
        made.append(proposal.confidence[0].tolist())
        return proposal

    def recording_observe(self, *args):
        confidence = args[7]
        if confidence[0] is not None:
            seen.append(confidence[0])
        return observe(self, *args)

    monkeypatch.setattr(DSparkProposer, "propose", recording_propose)
    monkeypatch.setattr(AdaptiveWidth, "observe", recording_observe)
    assert greedy(llm, PROMPTS[:1], n=40) == greedy(LLM(str(target), None, device="cpu"), PROMPTS[:1], n=40)
    assert len(seen) == len(made) >= 3
    for observed, proposed in zip(seen, made):
        assert 0 < len(observed) <= len(proposed)
        assert max(abs(a - b) for a, b in zip(observed, proposed)) <= 2**-24
    policy = llm.engine.adaptive  # every drafting step had confidences: its acceptances are all the counts'
    predicted, accepted = policy.calibration.counts
    assert predicted[0] > 0 and np.allclose(accepted, policy.counts.hits)


def test_confidences_read_back_per_sequence_and_none_for_drafts_made_before_the_step():
    """The packed outcome's confidence columns: each sequence's first w-1, and none where the step
    had drafts proposed before it (a grammar's), which pack -1."""
    drafts = torch.tensor([[5, 6, 7], [8, 9, 10]])
    known = StepOutcome.pack(torch.tensor([1, 2]), torch.tensor([0, 3]), torch.tensor([4, 4]), drafts,
                             torch.tensor([[0.25, 0.5, 0.75], [1.0, 0.125, 0.0]]))  # fmt: skip
    unknown = StepOutcome.pack(torch.tensor([1, 2]), torch.tensor([0, 3]), torch.tensor([4, 4]), drafts,
                               torch.full((2, 3), -1.0))  # fmt: skip
    out = finish_step(LaunchedStep([], [4, 2], StepOutcome(known), known, None, None, True))
    assert [o.confidence.tolist() for o in out] == [[0.25, 0.5, 0.75], [1.0]]
    assert [o.draft_token_ids for o in out] == [[5, 6, 7], [8]]
    out = finish_step(LaunchedStep([], [4, 2], StepOutcome(unknown), unknown, None, None, True))
    assert [o.confidence for o in out] == [None, None]


def test_confidences_and_chances_read_back_from_a_graphs_wider_outcome():
    """A CUDA graph captured at width class 8 packs 7 columns a block (drafts, confidences,
    chances) for steps of 5 and 3 rows: each sequence reads its own w-1 of each block, none of
    the padding rows' values."""
    drafts = torch.tensor([[5, 6, 7, 8, 0, 0, 0], [9, 10, 0, 0, 0, 0, 0]])
    confidence = torch.tensor([[0.25, 0.5, 0.75, 1.0, 0.5, 0.5, 0.5], [0.125, 0.0, 0.5, 0.5, 0.5, 0.5, 0.5]])
    chances = torch.tensor([[0.875, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    packed = StepOutcome.pack(torch.tensor([1, 2]), torch.tensor([1, 1]), torch.tensor([4, 4]), drafts, confidence,
                              chances)  # fmt: skip
    out = finish_step(LaunchedStep([], [5, 3], StepOutcome(packed), packed, None, None, True, True))
    assert [o.draft_token_ids for o in out] == [[5, 6, 7, 8], [9, 10]]
    assert [o.confidence.tolist() for o in out] == [[0.25, 0.5, 0.75, 1.0], [0.125, 0.0]]
    assert [o.chances.tolist() for o in out] == [[0.875, 0.5, 0.0, 0.0], [1.0, 0.0]]


@pytest.fixture(scope="module")
def sampling_target(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("dspark_sampling") / "t", "llama", vocab=VOCAB, seed=3)


def sampling_llm(target, drafter, **spec) -> LLM:
    config = {"model": str(drafter), "num_speculative_tokens": 2, "adaptive_width": False, **spec}
    return LLM(str(target), config, device="cpu", max_num_seqs=512)


@pytest.mark.parametrize("params", CASES, ids=["T1", "T0.8-topk4-topp0.9-minp0.2"])
@pytest.mark.parametrize(
    "kwargs,spec",
    [({}, {}), ({}, {"confidence_threshold": 0.5}), ({"draft_vocab": 4}, {})],
    ids=["markov", "confidence-cut", "reduced-vocab"],
)
def test_speculative_sampling_matches_target_distribution(tmp_path, sampling_target, params, kwargs, spec):
    d = make_dspark(tmp_path / "d", sampling_target, block_size=2, markov_rank=4, markov_scale=3.0, seed=5, **kwargs)
    counts, steps = sampled_counts(sampling_llm(sampling_target, d, **spec), params)
    assert {1, 3} <= set(steps)  # drafts rejected at once and all accepted
    assert chi_square_pvalue(counts, exact_distribution(sampling_target, params), N) > 1e-3


def test_confidence_cut_verifies_fewer_drafts(tmp_path, sampling_target, monkeypatch):
    """The cut happens (some blocks keep fewer drafts than the step's), and keeps a prefix."""
    d = make_dspark(tmp_path / "d", sampling_target, block_size=2, markov_rank=4, seed=5)
    kept, propose = [], DSparkProposer.propose

    def recorded(self, runner, inputs):
        proposal = propose(self, runner, inputs)
        kept.extend(proposal.num_drafts.tolist())
        return proposal

    monkeypatch.setattr(DSparkProposer, "propose", recorded)
    sampled_counts(sampling_llm(sampling_target, d, confidence_threshold=0.5), CASES[0])
    assert {0, 2} <= set(kept)


def test_proposal_without_the_markov_correction_is_caught(tmp_path, sampling_target, monkeypatch):
    """Drafts drawn from the corrected logits but verified against q of the base logits (the mistake
    the correction invites): the output distribution is no longer the target's."""
    d = make_dspark(tmp_path / "d", sampling_target, block_size=2, markov_rank=4, markov_scale=3.0, seed=5)
    chain = DSparkProposer.markov_chain

    def base_q(self, runner, inputs, hidden, base):
        proposal, embeddings = chain(self, runner, inputs, hidden, base)
        logits = self.drafter.to_target(base.float(), runner.target)
        proposal.q = probs(logits, inputs.sampling_params[:, None], inputs.filters)
        return proposal, embeddings

    monkeypatch.setattr(DSparkProposer, "markov_chain", base_q)
    counts, _ = sampled_counts(sampling_llm(sampling_target, d), CASES[0])
    assert chi_square_pvalue(counts, exact_distribution(sampling_target, CASES[0]), N) < 1e-6


def edit_weights(src, dst, change) -> str:
    rewrite(src, dst)
    weights = load_file(dst / "model.safetensors")
    save_file(change(weights), dst / "model.safetensors")
    return str(dst)


def test_mismatched_dspark_checkpoints(tmp_path, target):
    d = make_dspark(tmp_path / "d", target, draft_vocab=48)
    no_d2t = edit_weights(d, tmp_path / "no_d2t", lambda w: {k: v for k, v in w.items() if k != "d2t"})
    with pytest.raises(CheckpointError, match="draft_vocab_size 48 < the target's 128 needs the d2t tensor"):
        LLM(str(target), {"model": no_d2t}, device="cpu")
    twice = edit_weights(
        d, tmp_path / "twice", lambda w: {**w, "d2t": torch.eye(48, dtype=torch.long)[0]}
    )  # ids 1, 1, 2, ...
    with pytest.raises(CheckpointError, match="d2t maps draft ids outside the target vocabulary, or two to one id"):
        LLM(str(target), {"model": twice}, device="cpu")
    no_head = edit_weights(d, tmp_path / "no_head", lambda w: {k: v for k, v in w.items() if k != "lm_head.weight"})
    with pytest.raises(CheckpointError, match=r"tensors missing from the checkpoint: \['lm_head.weight'\]"):
        LLM(str(target), {"model": no_head}, device="cpu")
    full = make_dspark(tmp_path / "full", target)
    w1 = "markov_head.markov_w1.weight"
    other = edit_weights(full, tmp_path / "w1", lambda w: {**w, w1: w[w1][:100]})
    with pytest.raises(
        CheckpointError, match="markov_w1.weight embeds 100 token ids but the target's vocabulary has 128"
    ):
        LLM(str(target), {"model": other}, device="cpu")
    spec = make_dspark(tmp_path / "spec", target, "speculators")
    config = json.loads((spec / "config.json").read_text())
    del config["sample_from_anchor"]
    (spec / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        CheckpointError, match="a speculators DSpark config leaves its row convention open: set sample_from_anchor"
    ):
        LLM(str(target), {"model": str(spec)}, device="cpu")
    for i, (change, message) in enumerate(
        (
            ({"markov_head_type": "lstm"}, "markov_head_type 'lstm' is not supported"),
            ({"markov_rank": None}, r"markov_rank is missing \(0: no Markov head\)"),
            ({"markov_rank": 0}, "confidence_head_with_markov needs a Markov head"),
            ({"sample_from_anchor": "yes"}, "sample_from_anchor must be true or false"),
        )
    ):
        bad = rewrite(full, tmp_path / f"bad{i}", change)
        with pytest.raises(CheckpointError, match=message):
            LLM(str(target), {"model": str(bad)}, device="cpu")


def test_a_confidence_threshold_needs_a_confidence_head(tmp_path, target):
    d = make_dspark(tmp_path / "d", target, markov_rank=0, confidence=False)
    with pytest.raises(ValueError, match="confidence_threshold needs a drafter with a confidence head"):
        LLM(str(target), {"model": str(d), "confidence_threshold": 0.5}, device="cpu")


def test_speculators_bidirectional_sliding_layers():
    """speculators' sliding_window_non_causal: its sliding layers' blocks see the rows after them."""
    raw = {"speculators_model_type": "dflash", "transformer_layer_config": {"hidden_size": 8}}
    assert dialect_of(raw).read({**raw, "sliding_window_non_causal": True})["is_causal"] is False
    assert "is_causal" not in dialect_of(raw).read(raw)  # the reference's rule: sliding layers causal


def test_shipped_copies_of_the_target_are_shared(tmp_path, target):
    """DeepSpec ships the target's embedding and LM head: equal copies are not held twice, a
    different head is the drafter's own."""
    d = make_dspark(tmp_path / "d", target)
    t = load_target(target, torch.float32, CPU).model
    drafter = load_drafter(d, t, torch.float32, CPU)
    assert drafter.embed_tokens is None and drafter.lm_head is None
    own = edit_weights(d, tmp_path / "own", lambda w: {**w, "lm_head.weight": w["lm_head.weight"] * 2})
    drafter = load_drafter(own, t, torch.float32, CPU)
    assert drafter.embed_tokens is None and drafter.lm_head is not None


def test_methods_that_name_a_kind_hold_the_checkpoint_to_it(tmp_path, target):
    """ "dspark" and "dflash2" (vLLM's method names) load only a drafter of that kind; "dflash" any."""
    d = make_dspark(tmp_path / "d", target)
    assert LLM(str(target), {"method": "dspark", "model": str(d)}, device="cpu").engine.drafter.proposer == "dspark"
    assert LLM(str(target), {"method": "dflash", "model": str(d)}, device="cpu").engine.drafter.proposer == "dspark"
    with pytest.raises(ValueError, match="method 'dflash2' asks for a dflash2 drafter; .* is dspark"):
        LLM(str(target), {"method": "dflash2", "model": str(d)}, device="cpu")
    with pytest.raises(ValueError, match="speculative method 'eagle3' is not supported .*'dspark', 'ngram'"):
        LLM(str(target), {"method": "eagle3", "model": str(d)}, device="cpu")


def test_fp8_dspark_drafter_with_its_own_head(tmp_path, target):
    """FP8 projections (the CPU reference numerics) and an FP8 copy of the drafter's own reduced
    LM head in place of it: still exactly plain decoding."""
    d = make_dspark(tmp_path / "d", target, block_size=6, draft_vocab=48, markov_scale=4.0)
    llm = LLM(str(target), {"model": str(d), "fp8": "on"}, device="cpu")
    drafter = llm.engine.drafter
    assert drafter.fp8 and drafter.lm_head is None and drafter.lm_head_fp8 is not None
    assert greedy(llm, PROMPTS) == greedy(LLM(str(target), None, device="cpu"), PROMPTS)


class Fused(Exception):
    """Raised by a stand-in for the chain kernel: the proposer chose it."""


@pytest.mark.parametrize(
    "head,temperature,top_p,fused",
    [("vanilla", 0.0, 1.0, True), ("vanilla", 0.8, 1.0, True), ("vanilla", 0.8, 0.9, False), ("rnn", 0.0, 1.0, False)],
)
def test_which_chains_take_the_kernel(tmp_path, target, monkeypatch, head, temperature, top_p, fused):
    """The chain kernel serves a vanilla head, greedy or sampled without top-k, top-p or min-p; the
    rest run the reference's ops."""
    cpu = torch.device("cpu")
    model = load_target(target, torch.float32, cpu).model
    drafter = load_drafter(make_dspark(tmp_path / "d", target, head=head), model, torch.float32, cpu)
    kernel = SimpleNamespace(markov_chain=lambda *args: (_ for _ in ()).throw(Fused()))
    monkeypatch.setattr(dspark_proposer, "fast_kernels", lambda x, name: kernel)
    n, params = drafter.num_drafts, torch.tensor([[temperature, 0.0, top_p, 0.0]])
    inputs = SimpleNamespace(
        tokens=torch.tensor([[5]]), sampling=True if temperature else None, sampling_params=params,
        filters=top_p < 1, greedy=params[:, 0] == 0, seeds=torch.tensor([3]), draft_positions=torch.arange(1, n + 1)[None],
    )  # fmt: skip
    hidden, base = torch.zeros(1, n, 64), torch.randn(1, n, drafter.draft_vocab_size)
    proposer, runner = DSparkProposer(drafter), SimpleNamespace(target=model)
    if fused:
        with pytest.raises(Fused):
            proposer.markov_chain(runner, inputs, hidden, base)
    else:
        assert proposer.markov_chain(runner, inputs, hidden, base)[0].drafts.shape == (1, n)
