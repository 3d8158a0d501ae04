"""Structured output: the token masks against a dense reference, the host's walk of a block's drafts
through the grammar, speculative == plain decoding under a grammar (greedy, the shipped pair),
speculative sampling under a grammar with exactly the masked target distribution (chi-square, which
a wrong rule fails), and the refusals."""

import itertools
import json
import re
import sys

import openai
import pytest
import torch
from conftest import add_word_tokenizer, make_dflash2, make_drafter, make_dspark, make_target
from test_sampling import PROMPT, VOCAB, N, chi_square_pvalue
from transformers import AutoModelForCausalLM, AutoTokenizer

from blockspec import LLM, SamplingParams
from blockspec.engine import step
from blockspec.sampling import InvalidSamplingParam, token_probs
from blockspec.structured_output import Grammars, StructuredOutput, mask_logits, token_bitmasks

pytest.importorskip("xgrammar")

# Over the word tokenizer's tokens w0..w5 (eos w2): three tokens, then the end.
ALLOWED = ({0, 1, 3}, {1, 3, 4, 5}, {0, 4, 5})
REGEX = "".join("(" + "|".join(f"w{t}" for t in sorted(a)) + ")" for a in ALLOWED)


def allowed_tokens(bitmask_row, vocab: int) -> set[int]:
    return {v for v in range(vocab) if int(bitmask_row[v // 32]) >> (v % 32) & 1}


def test_mask_logits_against_a_dense_reference():
    g = torch.Generator().manual_seed(0)
    vocab = 70  # three words, the last one partly past the vocabulary
    logits = torch.randn(2, 3, vocab, generator=g)
    bitmask = torch.randint(-(2**31), 2**31, (2, 3, 3), generator=g, dtype=torch.int64).to(torch.int32)
    expected = torch.full_like(logits, float("-inf"))
    for b, r in itertools.product(range(2), range(3)):
        for v in allowed_tokens(bitmask[b, r], vocab):
            expected[b, r, v] = logits[b, r, v]
    assert torch.equal(mask_logits(logits, bitmask), expected)


@pytest.fixture(scope="module")
def word_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured")
    t = make_target(root / "t", "llama", vocab=VOCAB, seed=3)
    add_word_tokenizer(t, VOCAB)
    return t, make_drafter(root / "d", t, block_size=4, seed=5)


def test_rows_follow_the_drafts_and_the_matcher_ends_where_it_began(word_pair):
    grammars = Grammars(AutoTokenizer.from_pretrained(word_pair[0]), VOCAB)
    matcher = grammars.matcher(StructuredOutput(regex=REGEX), [2])
    everything = set(range(VOCAB))
    cases = {
        (1, 3, 4, 0, 2, 5): [*ALLOWED, {2}, everything, everything],  # the grammar's end, then unmasked
        (1, 4, 0, 5): [ALLOWED[0], everything, everything, everything],  # draft w4 is forbidden at once
        (1, 0, 1, 3): [*ALLOWED[:2], ALLOWED[2], everything],  # w3 forbidden in the third place
        (1,): [ALLOWED[0]],
    }
    for block, expected in cases.items():
        masks = token_bitmasks([matcher, None], [list(block), [1]], len(block), VOCAB)
        assert masks.shape == (2, len(block), 2)  # one word, padded to two
        assert [allowed_tokens(row, VOCAB) for row in masks[0]] == expected
        assert all(allowed_tokens(row, VOCAB) == everything for row in masks[1])
    assert matcher.accept_token(0) and not matcher.accept_token(0)  # still at the start: w0, then not w0


def masked_distribution(path, params: SamplingParams) -> dict[tuple, float]:
    """The exact distribution of the first three tokens of constrained plain decoding: each row's
    distribution restricted to the grammar's tokens there."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    dist = {}
    with torch.no_grad():
        for prefix in itertools.product(*map(sorted, ALLOWED[:2])):
            logits = model(torch.tensor([PROMPT + list(prefix)])).logits[0, len(PROMPT) - 1 :]
            for row, allowed in enumerate(ALLOWED):
                outside = [t for t in range(VOCAB) if t not in allowed]
                logits[row, outside] = float("-inf")
            p = token_probs(logits, params)
            for t in ALLOWED[2]:
                dist[prefix + (t,)] = float(p[0, prefix[0]] * p[1, prefix[1]] * p[2, t])
    return dist


def constrained_counts(llm: LLM, params: SamplingParams) -> tuple[dict, list[list[int]]]:
    spec = StructuredOutput(regex=REGEX)
    fields = {**params.__dict__, "max_tokens": 3, "structured_output": spec, "return_drafts": True}
    outs = llm.generate([PROMPT] * N, [SamplingParams(**{**fields, "seed": i}) for i in range(N)])
    counts = {}
    for o in outs:
        key = tuple(o.outputs[0].token_ids)
        counts[key] = counts.get(key, 0) + 1
    return counts, [o.metrics.draft_token_ids[0] for o in outs]


def wrong_masked_q(accept):
    """A plausible mistake: restricting the drafts' distribution q to the grammar as well, although
    the drafts were drawn from the unrestricted one."""

    def accept_with_masked_q(proposal, logits, inputs, *chances):
        if proposal.q is not None:
            q = torch.softmax(mask_logits(proposal.q.log(), inputs.bitmask[:, :-1]), dim=-1)
            proposal = step.Proposal(proposal.drafts, q, proposal.accepted, proposal.num_drafts)
        return accept(proposal, logits, inputs, *chances)

    return accept_with_masked_q


@pytest.mark.parametrize("wrong", [False, True], ids=["exact", "wrong-rule"])
def test_speculative_sampling_under_a_grammar_has_the_masked_distribution(word_pair, wrong, monkeypatch):
    t, d = word_pair
    if wrong:
        monkeypatch.setattr(step, "accept", wrong_masked_q(step.accept))
    spec = {"model": str(d), "num_speculative_tokens": 2, "adaptive_width": False}
    llm = LLM(str(t), spec, device="cpu", max_num_seqs=512)
    params = SamplingParams(temperature=1.0)
    counts, first_drafts = constrained_counts(llm, params)
    assert set(counts) <= set(itertools.product(*ALLOWED))  # every output follows the grammar
    assert any(d[0] not in ALLOWED[1] for d in first_drafts)  # and drafts it forbids were proposed
    pvalue = chi_square_pvalue(counts, masked_distribution(t, params), N)
    assert pvalue < 1e-6 if wrong else pvalue > 1e-3


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
    "required": ["name", "age", "city"],
}
CHATS = [
    "Give me a JSON object describing a person named Alice who is 31 and lives in Paris.",
    "Write a python function that adds two numbers.",
    "Describe the weather today.",
]


@pytest.fixture(scope="module")
def shipped():
    """The shipped pair with steps launched ahead where they may be (never past a grammar's
    sequence), and plain decoding."""
    spec = LLM(device="cpu", dtype="float32", async_steps=True)
    return spec, LLM(device="cpu", dtype="float32", speculative_config=None)


def test_speculative_equals_plain_under_grammars(shipped):
    spec, plain = shipped
    grammars = [StructuredOutput(json=SCHEMA), StructuredOutput(json_object=True), StructuredOutput(regex=r"(yes|no)")]
    params = [SamplingParams(temperature=0, max_tokens=48, structured_output=g) for g in grammars]
    params.append(SamplingParams(temperature=0, max_tokens=48))  # a free request in the same batch
    convs = [[{"role": "user", "content": c}] for c in CHATS]
    prompts = [(c, p) for c in convs for p in params]
    outs = {
        name: llm.chat([c for c, _ in prompts], [p for _, p in prompts])
        for name, llm in (("spec", spec), ("plain", plain))
    }
    assert [o.outputs[0].token_ids for o in outs["spec"]] == [o.outputs[0].token_ids for o in outs["plain"]]
    texts = [o.outputs[0] for o in outs["spec"]]
    for person in texts[0 :: len(params)]:  # complete outputs follow the schema
        if person.finish_reason == "stop":
            assert set(json.loads(person.text)) == {"name", "age", "city"}
    for answer in texts[2 :: len(params)]:
        assert answer.text in ("yes", "no") and answer.finish_reason == "stop"
    assert json.loads(texts[0].text) == {"name": "Alice", "age": 31, "city": "Paris"}


def test_structured_requests_refused_with_reasons(shipped):
    spec, _ = shipped
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutput(json=SCHEMA, regex="a")
    with pytest.raises(InvalidSamplingParam, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_output=StructuredOutput(json_object=True))
    cases = {
        "does not compile": SamplingParams(structured_output=StructuredOutput(json='{"type": "nonsense"}')),
        "has none": SamplingParams(ignore_eos=True, structured_output=StructuredOutput(json_object=True)),
    }
    for message, params in cases.items():
        with pytest.raises(InvalidSamplingParam, match=message) as e:
            spec.engine.add_request([1, 2, 3], params)
        assert e.value.param == "structured_output"
    assert not spec.engine.requests  # nothing was left behind
    ok = SamplingParams(
        ignore_eos=True, stop_token_ids=[5], max_tokens=4, structured_output=StructuredOutput(regex="a+")
    )
    assert re.fullmatch("a+", spec.generate([[1, 2, 3]], ok)[0].outputs[0].text)


def test_a_grammar_the_vocabulary_cannot_begin_is_refused(word_pair):
    llm = LLM(str(word_pair[0]), None, device="cpu")
    params = SamplingParams(structured_output=StructuredOutput(json_object=True))  # no "{" among words
    with pytest.raises(InvalidSamplingParam, match="none of the vocabulary's tokens"):
        llm.engine.add_request([1, 2, 3], params)


def test_response_format_through_the_openai_client(shipped):
    from test_server import KEY, NAME, serve

    spec, _ = shipped
    messages = [{"role": "user", "content": CHATS[0]}]
    formats = {
        "json_schema": StructuredOutput(json=SCHEMA),
        "json_object": StructuredOutput(json_object=True),
        "text": None,
    }
    with serve(spec) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
        for kind, structured in formats.items():
            body = {"type": kind} | (
                {"json_schema": {"name": "person", "schema": SCHEMA}} if structured and structured.json else {}
            )
            r = client.chat.completions.create(
                model=NAME, messages=messages, max_tokens=40, temperature=0, response_format=body
            )
            params = SamplingParams(temperature=0, max_tokens=40, structured_output=structured)
            assert r.choices[0].message.content == spec.chat(messages, params)[0].outputs[0].text
            if kind == "json_schema":
                assert json.loads(r.choices[0].message.content) == {"name": "Alice", "age": 31, "city": "Paris"}
            if kind == "json_object":  # cut at max_tokens, the grammar's prefix: an object begun
                assert r.choices[0].message.content.startswith('{"')
        bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=NAME, messages=messages, max_tokens=4, response_format=bad)
        assert e.value.param == "response_format" and "does not compile" in e.value.message


def test_a_dead_end_ends_the_request_and_spares_the_batch(word_pair):
    """Regex w1x over word tokens: w1 may begin it, and then no token goes on. That request ends
    (finish_reason abort, without the token drawn from nothing); the others in its steps do not."""
    t, d = word_pair
    llm = LLM(str(t), {"model": str(d), "num_speculative_tokens": 2}, device="cpu")
    dead = SamplingParams(temperature=0, max_tokens=8, structured_output=StructuredOutput(regex="w1x"))
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([PROMPT, PROMPT], [dead, free])
    assert outs[0].outputs[0].token_ids == [1] and outs[0].outputs[0].finish_reason == "abort"
    assert len(outs[1].outputs[0].token_ids) == 8 and outs[1].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("kind", ["dflash", "dspark", "dspark_confidence", "dflash2"])
def test_every_drafter_kind_under_a_grammar(tmp_path, kind):
    """Each proposer's drafts (DSpark's Markov chain and confidence cut, DFlash2's candidate walk)
    proposed before the verify: greedy tokens equal plain decoding's under the grammar, and
    sampled ones follow it."""
    t = add_word_tokenizer(make_target(tmp_path / "t", "llama", vocab=32, seed=1), 32)
    makers = {"dflash": make_drafter, "dspark": make_dspark, "dspark_confidence": make_dspark, "dflash2": make_dflash2}
    d = makers[kind](tmp_path / "d", t)
    spec = {"model": str(d), "adaptive_width": False}
    if kind == "dspark_confidence":
        spec["confidence_threshold"] = 0.3
    grammar = StructuredOutput(regex="(w[3-9])+")  # tokens w3..w9, then eos (w2) or more
    prompts = [[5, 9, 2, 11], [7, 3, 8], [(i * 7) % 30 for i in range(20)]]
    greedy = SamplingParams(temperature=0, max_tokens=16, structured_output=grammar)
    plain = LLM(str(t), None, device="cpu").generate(prompts, greedy)
    llm = LLM(str(t), spec, device="cpu")
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == [o.outputs[0].token_ids for o in plain]
    sampled = [SamplingParams(temperature=1.0, seed=i, max_tokens=16, structured_output=grammar) for i in range(3)]
    for o in llm.generate(prompts, sampled):
        *body, last = o.outputs[0].token_ids
        assert all(3 <= x <= 9 for x in body) and 2 <= last <= 9


def test_drafts_all_cut_leave_no_q(tmp_path):
    """DSpark's confidence cut keeps no draft (threshold 1): the sampled grammar step has width 1
    and no q, the mode warm-up captured for it."""
    t = add_word_tokenizer(make_target(tmp_path / "t", "llama", vocab=32, seed=1), 32)
    spec = {"model": str(make_dspark(tmp_path / "d", t)), "adaptive_width": False, "confidence_threshold": 1.0}
    llm = LLM(str(t), spec, device="cpu")
    runner, modes = llm.engine.runner, []
    verify = runner.step
    runner.step = lambda inputs: (modes.append(inputs.mode), verify(inputs))[1]
    params = SamplingParams(
        temperature=1.0, seed=0, max_tokens=4, structured_output=StructuredOutput(regex="(w[3-9])+")
    )
    assert all(3 <= x <= 9 for x in llm.generate([[5, 9, 2, 11]], params)[0].outputs[0].token_ids[:-1])
    assert modes and all(m == "sampled+grammar" for m in modes)


def test_without_xgrammar_a_structured_request_names_the_install(word_pair, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar raises ImportError
    llm = LLM(str(word_pair[0]), None, device="cpu")
    with pytest.raises(InvalidSamplingParam, match="pip install xgrammar"):
        llm.engine.add_request([1, 2, 3], SamplingParams(structured_output=StructuredOutput(regex="w3")))
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].outputs[0].token_ids  # the rest serves on


def test_grammar_steps_in_graphs_equal_eager(word_pair):
    """Structured steps through the graph cache (replayed by call on the CPU): a width-1 sampled
    step (no drafts, so no q) first, then seeded sampled requests whose steps carry q: the same
    tokens as an eager engine's (q crosses into the graphs of its own mode)."""
    from test_cuda_graphs import CpuGraphCache

    t, d = word_pair
    spec = {"model": str(d), "num_speculative_tokens": 2, "adaptive_width": False}
    eager, graphed = (LLM(str(t), spec, device="cpu", max_num_seqs=8) for _ in range(2))
    engine = graphed.engine
    engine.runner.graphs = CpuGraphCache(8, -(-engine.max_model_len // engine.config.page_size), (engine.max_width,))
    grammar = StructuredOutput(regex=REGEX)
    first = SamplingParams(temperature=1.0, seed=0, max_tokens=1, structured_output=grammar)
    sampled = [SamplingParams(temperature=1.0, seed=i, max_tokens=3, structured_output=grammar) for i in range(16)]
    for llm in (eager, graphed):
        llm.generate([PROMPT], first)
    outs = [[o.outputs[0].token_ids for o in llm.generate([PROMPT] * 16, sampled)] for llm in (eager, graphed)]
    assert outs[0] == outs[1]
    assert any("+q" in key[0] for key in engine.runner.graphs.graphs)


def test_choices_match_their_text_as_written(shipped):
    """Each choice, quotes, backslashes and characters past the BMP included, is accepted token by
    token to completion, and nothing else: `choice` literals keep non-ASCII as it is."""
    engine = shipped[0].engine
    choices = ['yes "sir" \\o/', "naïve 😀"]
    for text in [*choices, "yes"]:
        matcher = engine.structured_outputs().matcher(StructuredOutput(choice=choices), engine.target.eos_token_ids)
        accepted = all(matcher.accept_token(t) for t in engine.tokenizer.encode(text))
        assert (accepted and matcher.is_completed()) == (text in choices)
