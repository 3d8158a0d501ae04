"""`blockspec bench` end to end on the CPU, small random presets: it runs plain and speculative
decoding, greedy and sampled, writes its JSON, and splits the step into phases (marks recorded
inside the one step); the acceptance bench on local prompt files."""

import argparse
import dataclasses
import gzip
import json
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import add_word_tokenizer, make_drafter, make_dspark, make_target, twin_head_pair

from blockspec import LLM, SamplingParams
from blockspec.bench import acceptance, arrival, bench, determinism, meta, report, width_trace
from blockspec.bench import kernels as kernels_module
from blockspec.config import EngineConfig
from blockspec.engine.adaptive import AdaptiveWidth
from blockspec.engine.engine import StepRecord
from blockspec.engine.kv_cache import kv_token_bytes, state_bytes
from blockspec.layers.linear import Linear
from blockspec.loading.hf import load_target


def run_bench(tmp_path, monkeypatch, model: str, *flags: str) -> tuple[argparse.Namespace, dict]:
    """`blockspec bench` of `model` with the small DFlash drafter on the CPU in fp32 at simulated tau
    3, the copy bandwidth taken as 1e11 (2 GiB buffers otherwise): its arguments and JSON report."""
    monkeypatch.setattr(bench, "copy_bandwidth", lambda device: 1e11)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "bench.json"
    args = parser.parse_args(
        ["--model", model, "--draft", "random:small-DFlash", "--device", "cpu", "--dtype", "float32",
         "--warmup", "1", "--simulate-tau", "3", "--out", str(out), *flags]
    )  # fmt: skip
    bench.run(args)
    return args, json.loads(out.read_text())


@pytest.mark.parametrize("switch", ["on", "off"])
def test_bench_loads_packed_cpu_weights_as_switched(switch):
    """`--cpu-packed off` times the CPU's linears on F.linear: nothing packed at load."""
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--model", "random:small", "--draft", "random:small-DFlash", "--cpu-packed", switch])
    target, drafter = bench.load(args, torch.device("cpu"), torch.float32)
    linears = [m for model in (target.model, drafter) for m in model.modules() if isinstance(m, Linear)]
    assert linears and all((m.packed is not None) == (switch == "on") for m in linears)


@dataclasses.dataclass
class OnePromptAStep(EngineConfig):
    max_num_batched_tokens: int = 16  # the bench's 512-token prompts: one admitted a step


@pytest.mark.parametrize("temperature", ["0", "0.7"])
def test_bench_reports_both_modes_and_the_phase_split(tmp_path, monkeypatch, capsys, temperature):
    """... and times decoding steps only: a batch admitted over several steps is prefilled whole
    before the timed steps (each of them commits tokens for every sequence)."""
    monkeypatch.setattr(bench, "EngineConfig", OnePromptAStep)
    _, report = run_bench(
        tmp_path, monkeypatch, "random:small", "--batch-sizes", "1,2", "--steps", "3", "--temperature", temperature
    )
    results = report["results"]
    assert [(r["mode"], r["batch_size"]) for r in results] == [("plain", 1), ("dflash", 1), ("plain", 2), ("dflash", 2)]
    for r in results:
        phases = r["phases_ms"]
        assert r["tok_per_s"] > 0 and phases["verify"] > 0 and r["temperature"] == float(temperature)
        drafted = r["mode"] == "dflash"  # plain decoding's drafter and context phases are empty marks
        assert (phases["drafter"] > 0.1 * phases["verify"]) == drafted
        assert (phases["context"] > 0.01 * phases["verify"]) == drafted
        assert sum(r["tau_histogram"].values()) == 3 * r["batch_size"]  # every timed step of every sequence
        assert r["kernels"] == {}  # without --kernel-profile
    assert "acceptance SIMULATED" in capsys.readouterr().out


@pytest.mark.parametrize("temperature", ["0", "0.7"])
def test_simulated_acceptance_is_the_same_run_to_run(tmp_path, monkeypatch, temperature):
    """The bench's requests are seeded (sampled ones at fixed width): their simulated acceptance, a
    function of (seed, position), is the same in every run, so two builds' tok/s differ by their
    step times alone."""
    flags = ("--batch-sizes", "4", "--steps", "8", "--temperature", temperature)
    runs = [run_bench(tmp_path, monkeypatch, "random:small", *flags)[1]["results"] for _ in range(2)]
    first, second = ([r["tau_histogram"] for r in results if r["mode"] == "dflash"] for results in runs)
    assert first == second and len(first[0]) > 1  # and acceptance varies from block to block


def test_kernel_profile_splits_a_step_by_kernel(tmp_path, monkeypatch):
    """--kernel-profile: each measurement's ops (on the CPU) by time per step, longest first, the
    rest summed; a drafted step runs more ops than a plain one (the drafter's forward)."""
    _, profiled = run_bench(
        tmp_path, monkeypatch, "random:small", "--batch-sizes", "1", "--steps", "2", "--kernel-profile"
    )
    for r in profiled["results"]:
        kernels = r["kernels"]
        named = [k for k in kernels if k != kernels_module.OTHER]
        assert len(named) == kernels_module.TOP_KERNELS and kernels_module.OTHER in kernels
        times = [kernels[k]["ms_per_step"] for k in named]
        assert times == sorted(times, reverse=True) and times[-1] > 0
        assert all(kernels[k]["calls_per_step"] > 0 for k in kernels)
    calls = {r["mode"]: sum(k["calls_per_step"] for k in r["kernels"].values()) for r in profiled["results"]}
    assert calls["dflash"] > calls["plain"]


def test_kernel_times_are_per_step_and_keep_the_longest(monkeypatch):
    """A step of known ops: each op's calls divided by the steps exactly; past TOP_KERNELS the
    rest summed under OTHER, no call lost."""
    a = torch.randn(64, 64)

    def step():
        for _ in range(3):
            a @ a
        a.add(1).sub(1)

    times = kernels_module.kernel_times(step, 4, cuda=False)
    assert times["aten::mm"].calls_per_step == 3 and times["aten::add"].calls_per_step == 1
    assert times["aten::mm"].ms_per_step > 0
    monkeypatch.setattr(kernels_module, "TOP_KERNELS", 1)
    kept = kernels_module.kernel_times(step, 4, cuda=False)
    assert len(kept) == 2 and kernels_module.OTHER in kept
    assert sum(k.calls_per_step for k in kept.values()) == sum(k.calls_per_step for k in times.values())


def test_moe_floor_counts_the_experts_a_step_reads(tmp_path, monkeypatch):
    """An MoE target: a decode row reads its top 4 of 16 experts a layer, a block of varied drafts
    many more, and the floor counts only those (below that of every expert read)."""
    args, report = run_bench(tmp_path, monkeypatch, "random:small-moe", "--batch-sizes", "1", "--steps", "2")
    plain, dflash = report["results"]
    assert plain["experts_per_layer"] == 4 and dflash["experts_per_layer"] > 8
    target, _ = bench.load(args, torch.device("cpu"), torch.float32)
    assert plain["floor_ms"] < bench.weight_bytes(target.model, None) / 1e11 * 1e3


def test_hybrid_floor_counts_states_and_context_kv_at_each_prompt_length(tmp_path, monkeypatch):
    """A hybrid target's floor: its weights, every sequence's recurrent states read and written once
    a step, and the context K/V its attention layers (and the drafter's) read at the mean context of
    the timed steps, reported per prompt length; the rollback is a phase of its own."""
    flags = ("--batch-sizes", "2", "--steps", "2", "--prompt-len", "16,48")
    args, report = run_bench(tmp_path, monkeypatch, "random:small-hybrid", *flags)
    target, drafter = bench.load(args, torch.device("cpu"), torch.float32)
    per_token, per_slot = sum(kv_token_bytes(target.model.layers, 4).values()), state_bytes(target.model.layers, 4)
    assert per_slot == 6 * (4 * 64 * 64 * 4 + (2 * 128 + 256) * 3 * 4)  # 6 layers: fp32 state, conv's last 3 inputs
    assert per_token == 2 * (2 * 2 * 64 * 4)  # 2 full-attention layers, 2 K/V heads
    rows = report["results"]
    assert [(r["mode"], r["batch_size"]) for r in rows] == [("plain", 2), ("dflash", 2)] * 2
    for row, d, prompt_len in zip(rows, (None, drafter) * 2, (16, 16, 48, 48)):
        # 1 warmup step, then 2 timed ones of at most 16 rows each
        assert prompt_len < row["context"] < prompt_len + 3 * 16
        kv_per_token = per_token + (sum(kv_token_bytes(d.layers, 4).values()) if d is not None else 0)
        read = bench.weight_bytes(target.model, d) + 2 * 2 * per_slot + 2 * row["context"] * kv_per_token
        assert row["floor_ms"] == pytest.approx(read / report["meta"]["bandwidth_Bps"] * 1e3, rel=1e-9)
        assert "rollback" in row["phases_ms"]


def test_a_sliding_layer_reads_only_its_window(tmp_path):
    """gpt-oss alternates sliding (window 8) and full layers: past the window, the K/V bytes a
    step reads grow with the full layers alone."""
    target = load_target(make_target(tmp_path / "t", "gpt_oss"), torch.float32, torch.device("cpu"))
    layer = target.model.layers[0].mixer
    per_layer = 2 * layer.num_kv_heads * layer.head_dim * 4
    assert bench.kv_bytes(target.model, 6, 4) == 4 * 6 * per_layer
    assert bench.kv_bytes(target.model, 100, 4) == 2 * (8 + 100) * per_layer


def test_acceptance_compares_drafters_of_different_kinds(tmp_path):
    """`blockspec.bench.acceptance` with two --draft: each measured under its kind's name, beside
    plain decoding and the n-gram baseline, on the same prompts (local prompt files); with
    --widths 3, each also at a fixed block of 3 rows (at most 3 tokens a step); with --deferred-context,
    each also with adaptive width deferring the drafter's context."""
    target = add_word_tokenizer(make_target(tmp_path / "t", "qwen3"), 128)
    dflash, dspark = make_drafter(tmp_path / "dflash", target), make_dspark(tmp_path / "dspark", target)
    with gzip.open(tmp_path / "humaneval.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"prompt": p}) + "\n" for p in ("w5 w6 w7", "w9 w10", "w11 w12 w13"))
    (tmp_path / "mtbench.jsonl").write_text(json.dumps({"turns": ["w8 w9", "w10"]}) + "\n")
    parser = argparse.ArgumentParser()
    acceptance.add_arguments(parser)
    out = tmp_path / "acceptance.json"
    args = parser.parse_args(
        ["--model", str(target), "--draft", str(dflash), "--draft", str(dspark), "--device", "cpu",
         "--dtype", "float32", "--humaneval", str(tmp_path / "humaneval.jsonl.gz"), "--mtbench",
         str(tmp_path / "mtbench.jsonl"), "--max-tokens", "8", "--temperatures", "0", "--widths", "3",
         "--deferred-context", "4", "--out", str(out)]
    )  # fmt: skip
    acceptance.run(args)
    written = json.loads(out.read_text())
    rows = written["results"]
    assert [(r["set"], r["prompts"]) for r in rows] == [("humaneval", 3), ("mtbench", 1)]
    engines = ("plain", "ngram", "dflash", "dflash_adaptive", "dflash_adaptive_deferred", "dflash_w3")
    engines += ("dspark", "dspark_adaptive", "dspark_adaptive_deferred", "dspark_w3")
    # the second pass: the engines in turn, a prompt each (batch 1), every prompt's tokens counted
    assert all(set(engines) <= set(r) and all(r[e]["tokens"] == 8 * r["prompts"] for e in engines) for r in rows)
    assert written["meta"]["second_pass"] == "engines in turn" and written["meta"]["device"].startswith("cpu")
    assert all(max(map(int, r[e]["histogram"])) <= 3 for r in rows for e in ("dflash_w3", "dspark_w3"))
    widths = written["meta"]["max_width"]
    assert widths["dflash_w3"] == widths["dspark_w3"] == 3 and widths["dflash"] > 3 and widths["plain"] == 1
    deferred = written["meta"]["deferred_context"]  # the deferring engines' rings, none elsewhere
    assert deferred == {e: 4 if e.endswith("_deferred") else 0 for e in engines}
    assert all(r[e]["first_pass_tok_per_s"] > 0 for r in rows for e in engines)  # two passes, both timed
    # nothing built while serving: the CPU captures no graphs and compiles nothing at request time
    nothing = {"cuda_graphs": 0, "compiled": 0}
    assert all(r[e]["built"] == {"first_pass": nothing, "second_pass": nothing} for r in rows for e in engines)
    assert list(written["meta"]["engine_start_s"]) == list(engines)
    adaptive = [r[e] for r in rows for e in engines if "_adaptive" in e]
    # batch 1: a step per committed run of tokens, each counted at the width class it ran
    assert all(sum(v["width_steps"].values()) == sum(v["histogram"].values()) for v in adaptive)
    # the policy's step time estimates, at batch bucket 1 only (JSON keys), width 1 and wider ones
    assert all(list(v["width_ms"]) == ["1"] and "1" in v["width_ms"]["1"] for v in adaptive)
    assert all(len(v["width_ms"]["1"]) > 1 and min(v["width_ms"]["1"].values()) > 0 for v in adaptive)
    # milliseconds, of the order of the steps' mean (which holds prefills and host work): seconds or
    # microseconds would be 1000x off, while one step timed on a loaded machine may be 10x the mean
    for v in adaptive:
        mean_ms = 1e3 * v["tokens"] / v["tok_per_s"] / sum(v["histogram"].values())
        assert all(0.01 * mean_ms < ms < 100 * mean_ms for ms in v["width_ms"]["1"].values()), (mean_ms, v["width_ms"])
    assert not any("width_steps" in r[e] for r in rows for e in engines if "_adaptive" not in e)
    # every engine's realized steps: a call of one prompt steps once per committed run of tokens
    assert all(r[e]["steps_per_call"] == sum(r[e]["histogram"].values()) / r["prompts"] for r in rows for e in engines)
    # plain decoding at batch 1: a pair of each step and the one before it in its call
    pairs = [r["plain"]["step_pairs"]["1"]["1"] == sum(r["plain"]["histogram"].values()) - r["prompts"] for r in rows]
    assert all(set(r["plain"]["step_ms"]["1"]) == {"1"} for r in rows) and all(pairs)
    rendered = "\n".join(report.section(out))
    assert "First pass over second pass" in rendered and "Steps at each block width" in rendered
    assert "Built while serving" in rendered and "dspark_w3 0/0" in rendered
    assert "Estimated step ms" in rendered and "Realized step ms" in rendered


def test_the_step_log_marks_the_steps_whose_time_measures_their_width(tmp_path, monkeypatch):
    """A call's first step holds its prompts' prefill: not timed; every later one is, each at the
    rows it ran and its widest block, in order of completion. The bench keeps the log for its call
    only, an error in it included."""
    t = make_target(tmp_path / "t", "qwen3")
    spec = {"model": str(make_drafter(tmp_path / "d", t, block_size=8)), "adaptive_width": False}
    llm = LLM(str(t), spec, "cpu", "float32", max_num_seqs=2)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    served = acceptance.timed_generate(llm, [[5, 9], [7, 3, 1]], params)
    (log,) = served.steps
    lengths = [o.metrics.acceptance_lengths for o in served.outs]
    assert len(log) == max(map(len, lengths)) and [s.timed for s in log] == [False] + [True] * (len(log) - 1)
    assert [s.batch for s in log] == [sum(len(a) > i for a in lengths) for i in range(len(log))]
    assert all(s.width <= 8 for s in log) and log[0].width == 8
    assert [s.completed for s in log] == sorted(s.completed for s in log) and llm.engine.step_log is None
    monkeypatch.setattr(llm, "generate", lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        acceptance.timed_generate(llm, [[5, 9]], params)
    assert llm.engine.step_log is None


def test_realized_steps_time_steps_beside_their_own_width_class() -> None:
    """Only a timed step that follows one of its own width class at its own batch bucket, in the same
    `generate` call, times that pair, by the median of its pairs: the first step of each call, a
    step after another class or bucket, and an untimed step (a prefill or capture in it) time
    nothing; a width counts at its class (3 rows of a 16-row engine at class 4)."""
    first = [
        StepRecord(0.0, 1, 16, True), StepRecord(0.001, 1, 16, True), StepRecord(0.003, 1, 15, True),
        StepRecord(0.013, 1, 16, True), StepRecord(0.015, 1, 8, True), StepRecord(0.016, 1, 8, False),
        StepRecord(0.017, 4, 12, True), StepRecord(0.019, 3, 9, True),
    ]  # fmt: skip
    second = [StepRecord(5.0, 4, 16, True), StepRecord(5.004, 4, 3, True), StepRecord(5.006, 4, 4, True)]
    realized = acceptance.realized_steps([first, second], 16)
    assert realized["step_ms"] == {16: {1: 2.0, 4: 2.0}, 4: {4: 2.0}}  # (1, 2, 10) ms: median 2
    assert realized["step_pairs"] == {16: {1: 3, 4: 1}, 4: {4: 1}}
    assert realized["steps_per_call"] == 5.5
    assert acceptance.realized_steps([], 1) == {"step_ms": {}, "step_pairs": {}, "steps_per_call": 0}


def test_realized_steps_table_shows_the_largest_bucket_by_width() -> None:
    """The largest bucket and widths by number, from a file's string keys ("16" after "4"), each
    median with its pairs; an engine without step times shows its steps per call alone."""
    v = {"step_ms": {"4": {"4": 2.0}, "16": {"16": 1.46, "2": 1.0}}, "step_pairs": {"16": {"16": 9, "2": 3}}}
    rows = [{"set": "mtbench", "temperature": 0.0, "a": v | {"steps_per_call": 90.0}, "b": {"steps_per_call": 12.0}}]
    lines = report.realized_steps_table(rows, ["a", "b"])
    assert lines[-1] == "| mtbench | 0 | b16: w2 1.00 (3), w16 1.46 (9); 90.0 steps | 12.0 steps |"


def test_acceptance_second_pass_takes_turns(monkeypatch):
    """The first pass runs each engine over the prompts in batches, one engine after another (the
    batches of the second pass: the same work); in the second the engines take turns, a batch of
    prompts each, each batch starting one engine later, and each engine's second pass is summarized
    from its own batches' outputs and seconds, each pass's builds summed over its batches."""
    calls = []

    def timed(llm, prompts, params):
        calls.append((llm.name, prompts))
        first_pass = len(calls) <= 9  # 3 engines x 3 batches
        built = {"cuda_graphs": int(llm.name == "c" and first_pass), "compiled": int(llm.name == "b")}
        return acceptance.Served([llm.name] * len(prompts), 1.0 if llm.name == "a" else 2.0, built, [[]])

    monkeypatch.setattr(acceptance, "timed_generate", timed)
    monkeypatch.setattr(acceptance, "summarize", lambda outs, s: {"outs": outs, "tok_per_s": len(outs) / s})
    engines = {n: SimpleNamespace(name=n, engine=SimpleNamespace(adaptive=None, max_width=1)) for n in "abc"}
    rows = acceptance.two_passes(engines, [[1], [2], [3], [4], [5]], None, 2)
    first = [(n, batch) for n in "abc" for batch in ([[1], [2]], [[3], [4]], [[5]])]
    turns = [("a", [[1], [2]]), ("b", [[1], [2]]), ("c", [[1], [2]]), ("b", [[3], [4]]), ("c", [[3], [4]]),
             ("a", [[3], [4]]), ("c", [[5]]), ("a", [[5]]), ("b", [[5]])]  # fmt: skip
    assert calls == first + turns
    none = {"cuda_graphs": 0, "compiled": 0}
    assert rows["a"] == {
        "outs": ["a"] * 5, "tok_per_s": 5 / 3, "first_pass_tok_per_s": 5 / 3,
        "built": {"first_pass": none, "second_pass": none},
        "step_ms": {}, "step_pairs": {}, "steps_per_call": 0.0,
    }  # fmt: skip
    assert rows["b"]["tok_per_s"] == 5 / 6 and rows["c"]["first_pass_tok_per_s"] == 5 / 6
    assert rows["b"]["built"] == {
        "first_pass": {"cuda_graphs": 0, "compiled": 3},
        "second_pass": {"cuda_graphs": 0, "compiled": 3},
    }
    assert rows["c"]["built"] == {"first_pass": {"cuda_graphs": 3, "compiled": 0}, "second_pass": none}


def test_acceptance_rounds_are_timed_apart(monkeypatch):
    """Over two rounds each engine's second pass records each round's tok/s from its own batches:
    here engine a's second round runs at half the speed of its first."""
    seen = {}

    def timed(llm, prompts, params):
        seen[llm.name] = seen.get(llm.name, 0) + 1
        second_round = seen[llm.name] > 4  # 2 batches in the first pass, 2 in the first round
        return acceptance.Served([llm.name] * len(prompts), 2.0 if second_round and llm.name == "a" else 1.0, {}, [[]])

    monkeypatch.setattr(acceptance, "timed_generate", timed)
    monkeypatch.setattr(acceptance, "summarize", lambda outs, s: {"tok_per_s": len(outs) / s})
    engines = {n: SimpleNamespace(name=n, engine=SimpleNamespace(adaptive=None, max_width=1)) for n in "ab"}
    rows = acceptance.two_passes(engines, [[1], [2], [3]], None, 2, rounds=2)
    assert rows["a"]["round_tok_per_s"] == [3 / 2, 3 / 4] and rows["a"]["tok_per_s"] == 6 / 6
    assert rows["b"]["round_tok_per_s"] == [3 / 2, 3 / 2]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_width_trace_records_each_requests_blocks_and_each_widths_times(tmp_path, temperature):
    """A width trace of 3 requests in groups of 2, greedy or sampled: each request's
    full-width steps chain from position 0 (each block starts where the last one's tokens end) to
    its length; the forced run times more than one width class, each step within its group's batch
    size."""
    target = make_target(tmp_path / "t", "qwen3")
    llm = LLM(str(target), {"model": str(make_drafter(tmp_path / "d", target))}, "cpu", "float32", max_num_seqs=2)
    prompts = [[5, 9, 2, 11], list(range(20, 37)), [7, 7, 8]]
    params = SamplingParams(temperature=temperature, max_tokens=12, ignore_eos=True)
    trace = width_trace.record(llm, prompts, params, 2)
    assert [r["group"] for r in trace["requests"]] == [0, 0, 1]
    for r in trace["requests"]:
        ends = [start + accepted + 1 for start, accepted, *_ in r["accepted"]]
        assert [start for start, *_ in r["accepted"]] == [0, *ends[:-1]] and ends[-1] >= r["tokens"] == 12
        assert r["accepted"][-1][0] < r["tokens"]  # no step recorded past the request's end
    assert len({w for _, _, w, _, _ in trace["timed"]}) > 1 and all(ms > 0 for *_, ms, _ in trace["timed"])
    assert all(batch <= (2 if g == 0 else 1) and tokens >= 0 for g, batch, _, _, tokens in trace["timed"])
    for g in (0, 1):  # a group's tokens only grow along its steps
        tokens = [t for group, *_, t in trace["timed"] if group == g]
        assert tokens == sorted(tokens)
    assert type(llm.engine.adaptive) is AdaptiveWidth  # the engine's own policy back
    no_adaptive = LLM(str(target), {"model": str(tmp_path / "d"), "adaptive_width": False}, "cpu", "float32")
    with pytest.raises(ValueError, match="adaptive width"):
        width_trace.record(no_adaptive, prompts, SamplingParams(max_tokens=4), 1)


def test_width_trace_command_samples_at_its_temperature(tmp_path, monkeypatch):
    """`--temperature` reaches the recorded requests' sampling parameters and the trace's meta."""
    target, _, _ = acceptance_setup(tmp_path)  # the tiny word-tokenized target and its prompt files
    recorded = []
    real_record = width_trace.record
    monkeypatch.setattr(
        width_trace, "record", lambda llm, p, params, b: recorded.append(params) or real_record(llm, p, params, b)
    )
    parser = argparse.ArgumentParser()
    width_trace.add_arguments(parser)
    out = tmp_path / "trace.json"
    width_trace.run(parser.parse_args([
        "--model", str(target), "--draft", str(make_drafter(tmp_path / "d", target)), "--device", "cpu",
        "--dtype", "float32", "--humaneval", str(tmp_path / "humaneval.jsonl.gz"), "--max-tokens", "6",
        "--temperature", "0.8", "--out", str(out),
    ]))  # fmt: skip
    assert [p.temperature for p in recorded] == [0.8] and recorded[0].seed is None
    assert json.loads(out.read_text())["meta"]["temperature"] == 0.8


def acceptance_setup(tmp_path: Path) -> tuple[Path, argparse.ArgumentParser, list[str]]:
    """A tiny word-tokenized target, one-prompt HumanEval and MT-Bench files, the acceptance bench's
    parser and its arguments for them (6 greedy tokens, no adaptive or n-gram engines)."""
    target = add_word_tokenizer(make_target(tmp_path / "t", "qwen3"), 128)
    with gzip.open(tmp_path / "humaneval.jsonl.gz", "wt") as f:
        f.write(json.dumps({"prompt": "w5 w6 w7"}) + "\n")
    (tmp_path / "mtbench.jsonl").write_text(json.dumps({"turns": ["w8 w9"]}) + "\n")
    parser = argparse.ArgumentParser()
    acceptance.add_arguments(parser)
    common = ["--model", str(target), "--device", "cpu", "--dtype", "float32", "--humaneval",
              str(tmp_path / "humaneval.jsonl.gz"), "--mtbench", str(tmp_path / "mtbench.jsonl"), "--max-tokens", "6",
              "--temperatures", "0", "--no-adaptive", "--no-ngram"]  # fmt: skip
    return target, parser, common


def test_acceptance_names_drafters_apart(tmp_path):
    """--draft NAME=DIR measures two drafters of one kind side by side; --no-adaptive and
    --no-ngram leave those engines out; two drafters under one name are refused before any run."""
    target, parser, common = acceptance_setup(tmp_path)
    first, second = make_drafter(tmp_path / "a", target), make_drafter(tmp_path / "b", target, block_size=4)
    common += ["--out", str(tmp_path / "acceptance.json")]
    acceptance.run(parser.parse_args([*common, "--draft", f"old={first}", "--draft", f"new={second}"]))
    written = json.loads((tmp_path / "acceptance.json").read_text())
    assert list(written["meta"]["engine_start_s"]) == ["plain", "old", "new"]
    assert all(r["old"]["tokens"] == r["new"]["tokens"] == 6 for r in written["results"])
    assert written["meta"]["max_width"] == {"plain": 1, "old": 8, "new": 4}  # two drafters, not one twice
    with pytest.raises(ValueError, match="two drafters named 'dflash'"):
        acceptance.run(parser.parse_args([*common, "--draft", str(first), "--draft", str(second)]))
    sweep = tmp_path / "lr=3e-4"  # a directory whose path holds '=': no name, whatever precedes it
    assert acceptance.named_drafter(str(first)) == (None, str(first))
    assert acceptance.named_drafter(f"old={sweep}") == ("old", str(sweep))
    sweep.mkdir()
    assert acceptance.named_drafter(str(sweep)) == (None, str(sweep))


def test_acceptance_second_pass_goes_over_the_prompts_rounds_times(tmp_path):
    """--rounds N: the timed pass decodes every prompt N times (tokens N times the first pass's,
    the same greedy tau), recorded in the metadata; 0 rounds is refused."""
    target, parser, common = acceptance_setup(tmp_path)
    common += ["--draft", str(make_drafter(tmp_path / "a", target, block_size=4))]
    written = {}
    for rounds in (1, 3):
        out = tmp_path / f"rounds{rounds}.json"
        acceptance.run(parser.parse_args([*common, "--rounds", str(rounds), "--out", str(out)]))
        written[rounds] = json.loads(out.read_text())
        assert written[rounds]["meta"]["second_pass_rounds"] == rounds
    for once, thrice in zip(written[1]["results"], written[3]["results"]):
        for engine in ("plain", "dflash"):
            assert thrice[engine]["tokens"] == 3 * once[engine]["tokens"] == 18
            assert thrice[engine]["tau"] == once[engine]["tau"]
            # each round's tok/s, the whole pass's between the slowest and the fastest; one round: none
            rounds = thrice[engine]["round_tok_per_s"]
            assert len(rounds) == 3 and min(rounds) <= thrice[engine]["tok_per_s"] <= max(rounds)
            assert "round_tok_per_s" not in once[engine]
    rendered = "\n".join(report.section(tmp_path / "rounds3.json"))
    assert "Second pass by rounds" in rendered and "Second pass by rounds" not in "\n".join(
        report.section(tmp_path / "rounds1.json")
    )
    with pytest.raises(SystemExit):
        parser.parse_args(["--rounds", "0"])


def test_acceptance_refuses_a_block_without_drafts():
    parser = argparse.ArgumentParser()
    acceptance.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--widths", "4,1"])


def test_determinism_bench_counts_equal_outputs_per_row_invariance_setting(tmp_path):
    """`blockspec.bench.determinism` on local prompt files, at the twin-headed tiny pair in fp32
    (near-ties everywhere): with row invariance on, every prompt's speculative tokens are plain
    decoding's and the same alone; its rows render in docs/benchmarks.md's acceptance tables."""
    target, drafter = twin_head_pair(tmp_path, "qwen3", 1e-5)
    add_word_tokenizer(Path(target), 128)
    with gzip.open(tmp_path / "humaneval.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"prompt": " ".join(f"w{5 + i + j}" for j in range(3 + i))}) + "\n" for i in range(5))
    (tmp_path / "mtbench.jsonl").write_text(json.dumps({"turns": ["w8 w9 w40 w41", "w10"]}) + "\n")
    parser = argparse.ArgumentParser()
    determinism.add_arguments(parser)
    out = tmp_path / "determinism.json"
    args = parser.parse_args(
        ["--model", target, "--draft", drafter, "--device", "cpu", "--dtype", "float32", "--humaneval",
         str(tmp_path / "humaneval.jsonl.gz"), "--mtbench", str(tmp_path / "mtbench.jsonl"), "--max-tokens", "24",
         "--alone", "3", "--batch-size", "4", "--out", str(out)]
    )  # fmt: skip
    determinism.run(args)
    rows = json.loads(out.read_text())["results"]
    assert [(r["row_invariant"], r["set"], r["prompts"]) for r in rows] == [
        ("off", "humaneval", 5), ("off", "mtbench", 1), ("on", "humaneval", 5), ("on", "mtbench", 1)
    ]  # fmt: skip
    on = [r for r in rows if r["row_invariant"] == "on"]
    assert [(r["spec_equals_plain"], r["alone_equals_batch"]) for r in on] == [(5, "3/3"), (1, "1/1")]
    assert all(r["dflash"]["tau"] >= 1 for r in rows)
    assert "alone equals batch" in report.render([out])


def test_arrival_bench_times_a_long_prompt_chunked_and_whole(tmp_path):
    """A 40-token prompt arriving at 2 decoding sequences: with a budget of 8 its 39 tokens before
    the anchor take 5 steps, each giving the batch a token a sequence (the last one the prompt's
    first token too); whole, one step. With a 32-token system prompt, its second arrival finds
    those tokens cached."""
    out = tmp_path / "arrival.json"
    arrival.main(
        ["--model", "random:small", "--device", "cpu", "--dtype", "float32", "--batch", "2", "--prompt-len", "8",
         "--long-prompt", "40", "--budgets", "8,64", "--warmup", "2", "--system-prompt", "32", "--out", str(out)]
    )  # fmt: skip
    chunked, whole, miss, hit = json.loads(out.read_text())["results"]
    assert [r["mode"] for r in (chunked, whole, miss, hit)] == [
        "chunked 8", "whole prompt", "prefix cache miss", "prefix cache hit"
    ]  # fmt: skip
    assert (miss["cached_tokens"], hit["cached_tokens"]) == (0, 32)  # the system prompt's two pages
    for row in (chunked, whole, miss, hit):
        assert row["ttft_ms"] > 0 and row["tok_per_s"] > 0 and row["itl_max_ms"] >= row["itl_p50_ms"]
    assert chunked["tok_per_s"] * chunked["ttft_ms"] / 1e3 == pytest.approx(2 * 5)
    assert whole["tok_per_s"] * whole["ttft_ms"] / 1e3 == pytest.approx(2 * 1)


def test_run_meta_names_the_checkout_revision(tmp_path, monkeypatch):
    """A bench run from a git checkout records its commit (`+changes` with tracked files edited) as
    it was when the bench started; one from elsewhere records none."""
    root = Path(meta.__file__).resolve().parents[2]
    if (root / ".git").exists() and shutil.which("git"):
        head = subprocess.run(
            ["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        assert re.fullmatch(re.escape(head.stdout.strip()) + r"(\+changes)?", meta.source_revision())
        monkeypatch.setattr(meta, "START_REVISION", "abc1234")  # what the checkout was at the start
        assert meta.run_meta("blockspec.bench.bench", torch.device("cpu"), torch.float32)["revision"] == "abc1234"
    monkeypatch.setattr(meta, "__file__", str(tmp_path / "site" / "blockspec" / "bench" / "meta.py"))
    assert meta.source_revision() is None
    monkeypatch.setattr(meta, "START_REVISION", None)
    assert "revision" not in meta.run_meta("blockspec.bench.bench", torch.device("cpu"), torch.float32)


def acceptance_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    acceptance.add_arguments(parser)
    return parser.parse_args(list(flags))


def test_acceptance_bench_checks_its_files_and_flags_before_any_engine(tmp_path) -> None:
    """Each a ValueError naming the problem, raised before an engine loads (an engine would fail
    here: the model is a file that does not exist), not a traceback after the run."""
    mtbench = tmp_path / "question.jsonl"
    mtbench.write_text('{"turns": ["w5"]}\n')
    humaneval = tmp_path / "HumanEval.jsonl.gz"
    humaneval.write_bytes(gzip.compress(b'{"prompt": "def f():"}\n'))
    files = ["--model", str(tmp_path / "none.gguf"), "--humaneval", str(humaneval), "--mtbench", str(mtbench)]
    bad_rows = tmp_path / "rows.jsonl"
    bad_rows.write_text('{"question": "w5"}\n')
    cases = [
        (["--out", str(tmp_path / "missing" / "a.json")], "its directory does not exist or is not writable"),
        (["--limit", "0"], "--limit must be >= 1, got 0"),
        (["--temperatures", "0,abc"], "--temperatures must be numbers separated by commas"),
        (["--humaneval", str(mtbench)], "not a JSONL file of prompts"),  # not gzipped
        (["--mtbench", str(bad_rows)], "every row needs a non-empty 'turns'"),
    ]
    for flags, message in cases:
        with pytest.raises(ValueError, match=message):
            acceptance.run(acceptance_args(*files, *flags))
    with pytest.raises(FileNotFoundError, match="none.gguf"):  # the checks pass: the engine is next
        acceptance.run(acceptance_args(*files, "--out", str(tmp_path / "a.json")))


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--steps", "0"], "--steps must be >= 1 and --warmup >= 0"),
        (["--block-size", "1"], "--block-size must be >= 2"),
        (["--batch-sizes", "1,x"], "integers separated by commas"),
        (["--prompt-len", "0"], "--prompt-len and --batch-sizes must be >= 1"),
    ],
)
def test_engine_bench_checks_its_flags_before_loading(tmp_path, flags, message) -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--model", str(tmp_path / "none"), "--device", "cpu", *flags])
    with pytest.raises(ValueError, match=message):
        bench.run(args)
