"""`blockspec bench` end to end on the CPU, small random presets: it runs plain and speculative
decoding, greedy and sampled, writes its JSON, and splits the step into phases (marks recorded
inside the one step)."""

import argparse
import json

import pytest

from blockspec.bench import bench


@pytest.mark.parametrize("temperature", ["0", "0.7"])
def test_bench_reports_both_modes_and_the_phase_split(tmp_path, monkeypatch, capsys, temperature):
    monkeypatch.setattr(bench, "copy_bandwidth", lambda device: 1e11)  # 2 GiB buffers otherwise
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "bench.json"
    args = parser.parse_args(
        ["--model", "random:small", "--draft", "random:small-DFlash", "--device", "cpu", "--dtype", "float32",
         "--batch-sizes", "1,2", "--steps", "3", "--warmup", "1", "--simulate-tau", "3", "--out", str(out),
         "--temperature", temperature]
    )  # fmt: skip
    bench.run(args)
    results = json.loads(out.read_text())["results"]
    assert [(r["mode"], r["batch_size"]) for r in results] == [("plain", 1), ("dflash", 1), ("plain", 2), ("dflash", 2)]
    for r in results:
        phases = r["phases_ms"]
        assert r["tok_per_s"] > 0 and phases["verify"] > 0 and r["temperature"] == float(temperature)
        drafted = r["mode"] == "dflash"  # plain decoding's drafter and context phases are empty marks
        assert (phases["drafter"] > 0.1 * phases["verify"]) == drafted
        assert (phases["context"] > 0.01 * phases["verify"]) == drafted
        assert sum(r["tau_histogram"].values()) == 3 * r["batch_size"]  # every timed step of every sequence
    assert "acceptance SIMULATED" in capsys.readouterr().out
