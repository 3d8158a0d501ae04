"""Greedy speculative decoding is lossless: token for token equal to plain decoding on the
same engine and to transformers' generate(), across families, widths and batches; stop
conditions inside an accepted block cut exactly where plain decoding stops."""

import itertools
import re

import numpy as np
import pytest
import torch
from conftest import add_word_tokenizer, count_launches_ahead, make_drafter, make_target
from transformers import AutoModelForCausalLM

from blockspec import LLM, SamplingParams
from blockspec.cli import main as cli_main
from blockspec.proposers.ngram import lookup

PROMPTS = [[5], [9, 3, 7, 11, 40], list(range(20, 37)), [(7 * i) % 120 for i in range(33)]]
MAX_TOKENS = [20, 7, 25, 12]


def hf_greedy(path, prompt, n):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[0, len(prompt) :].tolist()


def run(llm, prompts=PROMPTS, max_tokens=MAX_TOKENS, **kw):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw) for n in max_tokens]
    return llm.generate(prompts, params)


@pytest.mark.parametrize("family,tied", [("llama", False), ("qwen2", True), ("qwen3", False)])
def test_greedy_speculative_equals_plain_and_transformers(tmp_path, family, tied):
    t = make_target(tmp_path / "t", family, tied, vocab=128)
    d = make_drafter(tmp_path / "d", t, block_size=8)
    expected = [hf_greedy(t, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    plain = [o.outputs[0].token_ids for o in run(LLM(str(t), None, device="cpu"))]
    assert plain == expected
    for n in (1, 3, 7):
        spec = LLM(str(t), {"model": str(d), "num_speculative_tokens": n}, device="cpu", page_size=4)
        outs = run(spec)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert all(1 <= a <= n + 1 for o in outs for a in o.metrics.acceptance_lengths)
    with pytest.raises(ValueError, match="num_speculative_tokens 8 is more than the drafter proposes: .* at most 7"):
        LLM(str(t), {"model": str(d), "num_speculative_tokens": 8}, device="cpu")


def test_ngram_greedy_equals_plain(tmp_path):
    t = make_target(tmp_path / "t", "llama", vocab=32)  # a small vocabulary repeats: lookups hit
    prompts = [[p % 32 for p in prompt] for prompt in PROMPTS]
    plain = [o.outputs[0].token_ids for o in run(LLM(str(t), None, device="cpu"), prompts)]
    llm = LLM(str(t), {"method": "ngram", "num_speculative_tokens": 5, "adaptive_width": False}, device="cpu")
    outs = run(llm, prompts)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert max(a for o in outs for a in o.metrics.acceptance_lengths) > 1


def test_ngram_lookup():
    tokens = np.array([1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 1, 2, 3])
    assert lookup(tokens, 1, 4, 3) == [4, 5, 1]  # latest earlier occurrence of [1, 2, 3]
    assert lookup(np.array([7, 8, 9]), 1, 4, 3) == []


def test_long_acceptance_and_stops_inside_blocks(tmp_path, oracle):
    t = add_word_tokenizer(make_target(tmp_path / "t", "qwen3", vocab=128), 128)
    d = make_drafter(tmp_path / "d", t, block_size=8)
    plain_llm = LLM(str(t), None, device="cpu")
    spec = LLM(str(t), {"model": str(d), "adaptive_width": False}, device="cpu", page_size=4)  # full blocks
    plain = run(plain_llm, max_tokens=[40] * 4)
    for p, o in zip(PROMPTS, plain):
        oracle[tuple(p)] = o.outputs[0].token_ids
    outs = run(spec, max_tokens=[40] * 4)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert max(a for o in outs for a in o.metrics.acceptance_lengths) >= 5  # blocks really were accepted
    full = plain[2].outputs[0].token_ids
    # stop token / max_tokens / stop string inside an accepted block: same cut as plain decoding
    for kw in ({"stop_token_ids": [full[13]]}, {"max_tokens": 11}, {"stop": f"w{full[9]} w{full[10]}"}):
        params = SamplingParams(temperature=0, **{"max_tokens": 40, "ignore_eos": True, **kw})
        a, b = spec.generate([PROMPTS[2]], params)[0], plain_llm.generate([PROMPTS[2]], params)[0]
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].text == b.outputs[0].text
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
    stopped = spec.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[full[13]]))[0]
    assert stopped.outputs[0].token_ids == full[: full.index(full[13]) + 1]
    assert stopped.outputs[0].finish_reason == "stop"
    # the stop token's id is returned, its text is not (vLLM's include_stop_str_in_output=False); the
    # text continues the prompt's (its leading space decoded in context)
    kept = full[: full.index(full[13])]
    assert spec.tokenizer.decode(PROMPTS[2]) + stopped.outputs[0].text == spec.tokenizer.decode(PROMPTS[2] + kept)
    cut = spec.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=40, stop=f"w{full[9]} w{full[10]}"))[0]
    assert f"w{full[9]} w{full[10]}" not in cut.outputs[0].text
    assert cut.outputs[0].token_ids == full[:11]  # ends at the token that completes the stop string


def test_eos_stops_and_drafts_are_returned(tmp_path, oracle):
    t = make_target(tmp_path / "t", "llama", vocab=128)
    d = make_drafter(tmp_path / "d", t, block_size=8)
    plain = LLM(str(t), None, device="cpu").generate(
        [PROMPTS[3]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    )
    full = plain[0].outputs[0].token_ids
    oracle[tuple(PROMPTS[3])] = full
    llm = LLM(str(t), {"model": str(d)}, device="cpu")
    llm.engine.target.eos_token_ids = [full[17]]
    out = llm.generate([PROMPTS[3]], SamplingParams(temperature=0, max_tokens=40, return_drafts=True))[0]
    assert out.outputs[0].token_ids == full[: full.index(full[17]) + 1]
    assert out.outputs[0].finish_reason == "stop"
    drafts = out.metrics.draft_token_ids
    assert len(drafts) == len(out.metrics.acceptance_lengths)
    assert all(len(d) <= 7 for d in drafts) and sum(out.metrics.acceptance_lengths) == len(out.outputs[0].token_ids)


@pytest.mark.parametrize("async_steps", [False, True], ids=["lock-step", "launched-ahead"])
def test_stream_yields_growing_outputs_that_end_as_generate(tmp_path, async_steps):
    t = add_word_tokenizer(make_target(tmp_path / "t", "qwen3", vocab=128), 128)
    drafter = {"model": str(make_drafter(tmp_path / "d", t, block_size=8))}
    llm = LLM(str(t), drafter, device="cpu", async_steps=async_steps)
    launched = count_launches_ahead(llm)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    parts = list(llm.stream("w5 w9 w11", params))
    ids = [p.outputs[0].token_ids for p in parts]
    assert all(a == b[: len(a)] and len(a) < len(b) for a, b in itertools.pairwise(ids))  # each step extends the last
    assert parts[-1].finished and not any(p.finished for p in parts[:-1])
    assert any(launched) == async_steps
    final = llm.generate("w5 w9 w11", params)[0]
    assert parts[-1].outputs[0].token_ids == final.outputs[0].token_ids
    assert parts[-1].outputs[0].text == final.outputs[0].text


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_sequences_ending_do_not_stall_the_steps_launched_ahead(tmp_path, speculative):
    """A sequence that the step in flight may take to max_tokens still gets a row in the step
    launched ahead (dropped where it ended), and one that ended (here on a stop token, mid-batch)
    is left out of the next: every step after the first is launched ahead but the one after the
    last sequence's end, and the outputs are those of steps taken one at a time."""
    t = make_target(tmp_path / "t", "qwen3", vocab=128)
    # the full block each step: a step's rows may run past a sequence's max_tokens
    drafter = {"model": str(make_drafter(tmp_path / "d", t, block_size=8)), "adaptive_width": False}
    drafter = drafter if speculative else None
    prompts = PROMPTS[1:]
    free = LLM(str(t), None, device="cpu").generate(prompts[2], SamplingParams(temperature=0, max_tokens=30))
    stop = free[0].outputs[0].token_ids[10]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (30, 5)]
    params.append(SamplingParams(temperature=0, max_tokens=30))  # ends on `stop`, at most 11 tokens in

    def run(async_steps: bool) -> tuple[list, list[bool]]:
        llm = LLM(str(t), drafter, device="cpu", async_steps=async_steps)
        llm.engine.target.eos_token_ids = [stop]
        launched = count_launches_ahead(llm)
        return [o.outputs[0] for o in llm.generate(prompts, params)], launched

    (ahead, launched), (lock_step, _) = run(True), run(False)
    assert [o.token_ids for o in ahead] == [o.token_ids for o in lock_step]
    assert [len(o.token_ids) for o in ahead[:2]] == [30, 5] and len(ahead[2].token_ids) <= 11
    assert ahead[2].finish_reason == "stop"
    assert len(launched) > 5 and all(launched[:-1]) and not launched[-1]


def test_streams_end_complete_when_others_drive_the_engine(tmp_path):
    """A generate (or another stream) run between two reads of a stream finishes its request:
    the stream still yields that final output."""
    t = make_target(tmp_path / "t", "qwen3", vocab=128)
    llm = LLM(str(t), {"model": str(make_drafter(tmp_path / "d", t, block_size=8))}, device="cpu")
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    expected = llm.generate([[5, 9, 11]], params)[0].outputs[0].token_ids
    first, second = llm.stream([5, 9, 11], params), llm.stream([5, 9, 11], params)
    assert not next(first).finished and not next(second).finished
    llm.generate([[7, 8]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))  # finishes both
    for stream in (first, second):
        last = list(stream)[-1]
        assert last.finished and last.outputs[0].token_ids == expected


def test_max_tokens_none_runs_to_the_context_limit(tmp_path):
    t = make_target(tmp_path / "t", "qwen3", vocab=128)
    llm = LLM(str(t), {"model": str(make_drafter(tmp_path / "d", t))}, device="cpu", max_model_len=40)
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    out = llm.generate([[5, 9, 11], [7]], params)
    assert [len(o.outputs[0].token_ids) for o in out] == [37, 39]
    assert {o.outputs[0].finish_reason for o in out} == {"length"} and params.max_tokens is None


def test_stream_texts_extend_each_other_up_to_a_stop_string(tmp_path):
    """One token a step (plain decoding): the step that ends inside a stop string must not show
    the part of it that the next step cuts off."""
    t = add_word_tokenizer(make_target(tmp_path / "t", "qwen3", vocab=128), 128)
    llm = LLM(str(t), None, device="cpu")
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    words = llm.generate("w5 w9 w11", greedy)[0].outputs[0].text.split()
    stop = f"{words[5][-1]} {words[6]}"  # from the end of one token into the next
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])
    texts = [p.outputs[0].text for p in llm.stream("w5 w9 w11", params)]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts)), texts
    assert texts[-1] == llm.generate("w5 w9 w11", params)[0].outputs[0].text and stop not in texts[-1]


def test_cli_generate_reports_load_decode_and_the_gain_over_plain(tmp_path, capsys):
    """`blockspec generate --compare`: the summary separates load time from decoding tok/s and
    states the acceptance length and the speedup over plain decoding of the same prompt."""
    t = add_word_tokenizer(make_target(tmp_path / "t", "qwen3", vocab=128), 128)
    d = make_drafter(tmp_path / "d", t, block_size=4)
    cli_main(
        [
            "generate",
            "w5 w6",
            "--model",
            str(t),
            "--draft",
            str(d),
            "--device",
            "cpu",
            "--max-tokens",
            "12",
            "--compare",
        ]
    )
    summary = capsys.readouterr().err.strip().splitlines()[-1]
    pattern = r"\[12 tokens, [\d.]+ tok/s decoding \(load [\d.]+ s\), mean acceptance length [\d.]+, "
    assert re.fullmatch(pattern + r"[\d.]+x plain decoding \([\d.]+ tok/s\), finish: length\]", summary)
    cli_main(["generate", "w5 w6", "--model", str(t), "--draft", "none", "--device", "cpu", "--max-tokens", "5"])
    assert re.fullmatch(
        r"\[5 tokens, [\d.]+ tok/s decoding \(load [\d.]+ s\), finish: length\]", capsys.readouterr().err.strip()
    )
