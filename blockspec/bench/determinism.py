"""Does a greedy request's output depend on the load? On real prompts (HumanEval, MT-Bench first
turns, chat template applied) at T=0, per row-invariance setting (`EngineConfig.row_invariant`):
how many prompts speculative decoding (adaptive width, the default) gives exactly plain
decoding's tokens, batched; how many of the first `--alone` give the same tokens alone as in the
batch; and the drafter's tau. No speeds: the engine bench (`--row-invariant`) times the cost.
Rows in the acceptance bench's shape, for `bench.report`."""

import argparse
import json
from pathlib import Path

from blockspec.bench.acceptance import humaneval_prompts, mtbench_prompts
from blockspec.bench.meta import run_meta
from blockspec.llm import DEFAULT_DRAFTER, LLM
from blockspec.sampling import SamplingParams


def tokens(outs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="target (default: the embedded SmolLM2)")
    p.add_argument("--draft", default=None, help="drafter directory (default: the shipped one)")
    p.add_argument("--humaneval", default=None)
    p.add_argument("--mtbench", default=None)
    p.add_argument("--limit", type=int, default=30, help="prompts per set")
    p.add_argument("--alone", type=int, default=8, help="prompts per set also decoded alone")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16, help="sequences decoded together")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--out", default="determinism.json")


def run(args: argparse.Namespace) -> None:
    draft = args.draft or str(DEFAULT_DRAFTER)
    sets = {"humaneval": humaneval_prompts(args.humaneval), "mtbench": mtbench_prompts(args.mtbench)}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    results = []
    for setting in ("off", "on"):
        options = {"max_num_seqs": args.batch_size, "row_invariant": setting == "on"}
        plain = LLM(args.model, None, args.device, args.dtype, **options)
        spec = LLM(args.model, {"model": draft}, args.device, args.dtype, **options)
        for name, texts in sets.items():
            prompts = [plain.chat_prompt([{"role": "user", "content": t}]) for t in texts[: args.limit]]
            expected = tokens(plain.generate(prompts, params))
            outs = spec.generate(prompts, params)
            batched = tokens(outs)
            alone = [tokens(spec.generate(p, params))[0] for p in prompts[: args.alone]]
            row = {"set": name, "temperature": 0.0, "prompts": len(prompts), "row_invariant": setting, "plain": {}}
            taus = [a for o in outs for a in o.metrics.acceptance_lengths]
            row[spec.engine.drafter.proposer] = {"tau": sum(taus) / len(taus)}
            row["spec_equals_plain"] = sum(a == b for a, b in zip(batched, expected))
            row["alone_equals_batch"] = f"{sum(a == b for a, b in zip(alone, batched))}/{len(alone)}"
            results.append(row)
            print(
                f"row_invariant {setting:3} {name:9} spec == plain {row['spec_equals_plain']}/{len(prompts)}, "
                f"alone == batch {row['alone_equals_batch']}",
                flush=True,
            )
            meta = run_meta("blockspec.bench.determinism", spec.engine.device, spec.dtype)
            Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=2))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m blockspec.bench.determinism", description=__doc__)
    add_arguments(parser)
    run(parser.parse_args())
