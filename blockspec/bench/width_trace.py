"""Width traces: real requests decoded on one engine with its widths forced, recorded so that the
adaptive width policy can be replayed on them offline (`tests/test_adaptive.py`).

The prompts run in groups of the batch size, twice. First every step at the widest block the
requests allow: per request, each step's accepted drafts by the position its block started at
(greedy output does not depend on the width, so these say what a narrower block from any position
would accept, up to the drafts a block started elsewhere would make), and the chances of
acceptance the step reported for its drafts reached, which the policy counts. Then with the width forced
through the classes, a run of steps each: each timed step's batch, width and milliseconds, with
the tokens its group had committed by then, so that a replay takes a width's time from the
machine as it was at that point of the run (the batch shrinking as requests finish, the contexts
growing, the machine's load). Also the step times the engine measured when it started, which
its policy starts from.

At a temperature above 0 (`--temperature`) the requests are unseeded (a seeded one keeps the full
block, so that its text does not depend on the widths), and the full-block run's acceptances are
those of one sampled text: a narrower block would sample another, so a replay holds for the
acceptance statistics, not token for token.

    python -m blockspec.bench.width_trace --model M --draft D --batch-size 16 --limit 64 \\
        --set humaneval --humaneval HumanEval.jsonl.gz --out trace.json"""

import argparse
import json
from pathlib import Path

import numpy as np

from blockspec.bench.acceptance import humaneval_prompts, in_groups, mtbench_prompts
from blockspec.bench.meta import run_meta
from blockspec.engine.adaptive import AdaptiveWidth, is_timing
from blockspec.llm import DEFAULT_DRAFTER, LLM
from blockspec.sampling import SamplingParams


class ForcedWidths(AdaptiveWidth):
    """A width policy that does not choose: each step runs the widest class the requests allow
    (`cycle` False) or the classes in turn, `run_length` steps each (so that steps launched ahead
    are timed: `AdaptiveWidth`'s note). It records what each step did."""

    def __init__(self, max_width: int, run_length: int, cycle: bool) -> None:
        super().__init__(max_width, run_length)
        self.cycle, self.turn = cycle, 0
        self.positions: dict[str, int] = {}  # request id -> tokens it has committed
        # request id -> [position, accepted drafts] a step, and where the step reported them the
        # chances of acceptance of its drafts reached (`step.Verdict.chances`), rounded to 1e-4
        self.accepted: dict[str, list[list]] = {}
        self.timed: list[list] = []  # [batch, width, ms, tokens] of each timed step
        self.tokens = 0  # committed by the requests of the group under way

    def choose(self, batch: int, limit: int, rows: list[str] = ()) -> int:
        widest = self.row_class(limit)
        if not self.cycle:
            return widest
        width = self.classes[(self.turn // self.run_length) % len(self.classes)]
        self.turn += 1
        return min(width, widest)

    def observe(
        self,
        batch: int,
        width: int,
        seconds: float | None,
        offered: list[int],
        accepted: list[int],
        beside: tuple[int | None, ...] = (),
        rows: list[str] = (),
        confidence: list[np.ndarray | None] = (),
        chances: list[np.ndarray | None] = (),
    ) -> None:
        if is_timing(width, seconds, beside):
            self.timed.append([batch, width, round(seconds * 1e3, 4), self.tokens])
        for i, (row, n) in enumerate(zip(rows, accepted)):
            start = self.positions.get(row, 0)
            step = [start, n]
            if i < len(chances) and chances[i] is not None:
                step.append([round(float(c), 4) for c in chances[i][: min(n + 1, offered[i])]])
            self.accepted.setdefault(row, []).append(step)
            self.positions[row] = start + n + 1
        self.tokens += sum(accepted) + len(accepted)


def record(llm: LLM, prompts: list[list[int]], params: SamplingParams, group: int) -> dict:
    """The trace of `prompts` decoded in groups of `group` on `llm` (an engine with adaptive width,
    so that it holds every width class): {"start": {bucket: {width: ms}} the engine timed when it
    started, "requests": [{"group", "tokens", "accepted"}], "timed": [[group, batch, width, ms,
    tokens], ...]}."""
    engine = llm.engine
    if engine.adaptive is None:
        raise ValueError("a width trace needs an engine with adaptive width (every width class)")
    start = {  # the step times the engine measured when it started (`AdaptiveWidth.start_from`)
        batch: {w: round(costs.seconds * r * 1e3, 4) for w, r in costs.ratio.items()}
        for batch, costs in engine.adaptive.costs.items()
    }
    groups = in_groups(prompts, group)
    runs, adaptive = {}, engine.adaptive
    try:
        for cycle in (False, True):
            policy = engine.adaptive = ForcedWidths(engine.max_width, adaptive.run_length, cycle)
            outs, timed = [], []
            for g, batch in enumerate(groups):
                policy.tokens, first = 0, len(policy.timed)
                outs.append(llm.generate(batch, params))
                timed += [[g, *step] for step in policy.timed[first:]]
            runs[cycle] = outs, policy, timed
    finally:
        engine.adaptive = adaptive
    outs, full, _ = runs[False]
    requests = [
        {"group": g, "tokens": len(o.outputs[0].token_ids), "accepted": full.accepted.get(o.request_id, [])}
        for g, group_outs in enumerate(outs)
        for o in group_outs
    ]
    return {"start": start, "requests": requests, "timed": runs[True][2]}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="target (default: the embedded SmolLM2)")
    p.add_argument("--draft", default=None, help="drafter directory (default: the shipped one)")
    p.add_argument("--set", choices=("humaneval", "mtbench"), default="humaneval")
    p.add_argument("--humaneval", default=None)
    p.add_argument("--mtbench", default=None)
    p.add_argument("--limit", type=int, default=16, help="prompts")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=1, help="prompts decoded together")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--out", default="width_trace.json")


def run(args: argparse.Namespace) -> None:
    draft = args.draft or str(DEFAULT_DRAFTER)
    llm = LLM(args.model, {"model": draft}, args.device, args.dtype, max_num_seqs=args.batch_size, prefix_caching=False)
    texts = humaneval_prompts(args.humaneval) if args.set == "humaneval" else mtbench_prompts(args.mtbench)
    prompts = [llm.chat_prompt([{"role": "user", "content": t}]) for t in texts[: args.limit]]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    trace = record(llm, prompts, params, args.batch_size)
    engine = llm.engine
    meta = run_meta(
        "blockspec.bench.width_trace",
        engine.device,
        engine.dtype,
        set=args.set,
        batch_size=args.batch_size,
        temperature=args.temperature,
    )
    Path(args.out).write_text(json.dumps({"meta": meta, **trace}))
    print(f"{len(trace['requests'])} requests, {len(trace['timed'])} timed steps -> {args.out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m blockspec.bench.width_trace", description=__doc__)
    add_arguments(parser)
    run(parser.parse_args())
