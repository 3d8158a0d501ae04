"""`python -m blockspec.bench.arrival`: a long prompt arrives while a batch decodes.

Per prefill budget (`max_num_batched_tokens`, the tokens of prompt a step prefills): the long
prompt's time to first token, and the decoding batch's inter-token latency meanwhile (median and
worst gap between steps that gave it tokens) and its tok/s. A budget at least the prompt's length
prefills it whole, in one step that every running sequence waits for. Each budget runs the arrival
twice on one engine and reports the second (the first compiles the prefill's kernels).

With `--system-prompt N`, also the prefix cache's worth: the long prompt is an N-token system
prompt and a question, arriving again with other questions; the first computes the system prompt
(`prefix cache miss`), the first to find it cached is timed too (`prefix cache hit`, `cached_tokens`).
Writes the engine bench's JSON shape (`blockspec.bench.report` renders it)."""

import argparse
import json
import statistics
import time

import torch

from blockspec.bench.bench import add_load_arguments, load, sync
from blockspec.bench.meta import run_meta
from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.engine.engine import LLMEngine
from blockspec.engine.sequence import Sequence
from blockspec.llm import free_device_memory, resolve_device, resolve_dtype
from blockspec.sampling import SamplingParams


def random_prompt(engine: LLMEngine, n: int, gen: torch.Generator) -> list[int]:
    return torch.randint(0, engine.vocab_size - 1, (n,), generator=gen).tolist()


def arrival(engine: LLMEngine, running: list[Sequence], prompt: list[int]) -> dict:
    """Add `prompt` and step until its first token: the timings of that window."""
    long = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    sync(engine.device)
    start = last = time.perf_counter()
    gaps, tokens = [], 0
    while not long.finished:
        before = sum(s.num_generated for s in running)
        engine.step()
        sync(engine.device)
        now = time.perf_counter()
        got = sum(s.num_generated for s in running) - before
        if got:
            gaps.append(now - last)
            tokens, last = tokens + got, now
    elapsed = time.perf_counter() - start
    return {
        "ttft_ms": elapsed * 1e3,
        "itl_p50_ms": statistics.median(gaps) * 1e3 if gaps else None,
        "itl_max_ms": max(gaps) * 1e3 if gaps else None,
        "tok_per_s": tokens / elapsed,
    }


def decoding_engine(target, drafter, args, budget: int, prefix_caching: bool) -> tuple[LLMEngine, list[Sequence]]:
    """An engine whose batch of `args.batch` sequences is decoding, warmed up."""
    spec = SpeculativeConfig(simulate_tau=args.simulate_tau) if drafter is not None else None
    max_len = args.long_prompt + 64
    config = EngineConfig(
        max_num_seqs=args.batch + 1, max_model_len=max_len, max_num_batched_tokens=budget, prefix_caching=prefix_caching
    )
    engine = LLMEngine(target, drafter, spec, config)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=max_len - args.prompt_len - 1, ignore_eos=True)
    running = [engine.add_request(random_prompt(engine, args.prompt_len, gen), params) for _ in range(args.batch)]
    for _ in range(args.warmup):
        engine.step()
    return engine, running


def run_budget(target, drafter, args, budget: int) -> dict:
    engine, running = decoding_engine(target, drafter, args, budget, prefix_caching=False)
    gen = torch.Generator().manual_seed(1)
    arrival(engine, running, random_prompt(engine, args.long_prompt, gen))  # compiles, captures
    m = arrival(engine, running, random_prompt(engine, args.long_prompt, gen))
    del engine
    free_device_memory()
    mode = f"chunked {budget}" if budget < args.long_prompt else "whole prompt"
    return {"mode": mode, "batch_size": args.batch, "prompt_tokens": args.long_prompt} | m


def run_prefix(target, drafter, args, budget: int) -> list[dict]:
    """A system prompt's first arrival (a miss) and its first arrival that finds it cached (a hit:
    the second, or on a linear-attention target the third, the second checkpointing the states
    there), twice over with another system prompt; the second pair is reported (the first
    compiles)."""
    engine, running = decoding_engine(target, drafter, args, budget, prefix_caching=True)
    gen = torch.Generator().manual_seed(1)
    question = args.long_prompt - args.system_prompt
    for _ in range(2):
        system = random_prompt(engine, args.system_prompt, gen)
        arrivals = (
            cached_arrival(engine, running, args, system + random_prompt(engine, question, gen)) for _ in range(3)
        )
        miss = next(arrivals)
        hit = next((r for r in arrivals if r["cached_tokens"]), None)  # the second, or a hybrid's third
        if hit is None:
            raise RuntimeError("the system prompt was not found in the prefix cache")
    del engine
    free_device_memory()
    return [{"mode": "prefix cache miss"} | miss, {"mode": "prefix cache hit"} | hit]


def cached_arrival(engine: LLMEngine, running: list[Sequence], args, prompt: list[int]) -> dict:
    """A long prompt's arrival, with the prompt tokens it found in the prefix cache."""
    before = engine.scheduler.kv_cache_manager.hits
    m = arrival(engine, running, prompt)
    cached = engine.scheduler.kv_cache_manager.hits - before
    return {"batch_size": args.batch, "prompt_tokens": args.long_prompt} | m | {"cached_tokens": cached}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m blockspec.bench.arrival", description=__doc__)
    p.add_argument("--model", default="random:Qwen3-8B")
    p.add_argument("--draft", default="none", help="drafter directory, random:<preset> or none")
    p.add_argument("--simulate-tau", type=float, default=None)
    p.add_argument("--batch", type=int, default=8, help="sequences decoding when the prompt arrives")
    p.add_argument("--prompt-len", type=int, default=512, help="their prompts' length")
    p.add_argument("--long-prompt", type=int, default=32768)
    p.add_argument("--budgets", default="8192,32768", help="max_num_batched_tokens values to compare")
    p.add_argument(
        "--system-prompt", type=int, default=0, help="N > 0: also time a prompt whose first N tokens are cached"
    )
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    add_load_arguments(p)
    p.add_argument("--out", default="arrival.json")
    args = p.parse_args(argv)
    if args.system_prompt >= args.long_prompt:
        p.error(f"--system-prompt ({args.system_prompt}) must be shorter than --long-prompt ({args.long_prompt})")
    if 0 < args.system_prompt < EngineConfig.page_size:
        p.error(f"--system-prompt ({args.system_prompt}) must fill a cache page ({EngineConfig.page_size} tokens)")
    args.draft = None if args.draft == "none" else args.draft
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    target, drafter = load(args, device, dtype)
    budgets = [int(b) for b in args.budgets.split(",")]
    rows = [run_budget(target, drafter, args, b) for b in budgets]
    if args.system_prompt:
        rows += run_prefix(target, drafter, args, max(budgets))
    for r in rows:
        print(json.dumps(r))
    meta = run_meta(
        "blockspec.bench.arrival", device, dtype, model=args.model, draft=args.draft, simulated_tau=args.simulate_tau
    )
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
