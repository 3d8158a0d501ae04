"""Load test for a running `blockspec serve`: N concurrent clients send completions back to
back until R requests are done; reports requests/s, latency percentiles and every request
that failed (an error status) or was lost (no answer: connection error or timeout).

    python -m blockspec.bench.serve_load --url http://127.0.0.1:8000 --clients 64 --requests 256
"""

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field

import httpx

PROMPTS = [
    "Write a Python function that reverses a string.",
    "Explain what a hash table is in two sentences.",
    "List three uses of the Linux command grep.",
    "What is the capital of France, and why is it famous?",
]


@dataclass
class Tally:
    latencies: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    failed: list[str] = field(default_factory=list)  # an answer, but an error
    lost: list[str] = field(default_factory=list)  # no answer at all


async def one_request(client: httpx.AsyncClient, args: argparse.Namespace, i: int, tally: Tally) -> None:
    body = {
        "model": args.model,
        "prompt": PROMPTS[i % len(PROMPTS)],
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "ignore_eos": args.ignore_eos,
    }
    start = time.perf_counter()
    try:
        r = await client.post("/v1/completions", json=body)
    except httpx.HTTPError as e:
        tally.lost.append(f"request {i}: {type(e).__name__}: {e}")
        return
    if r.status_code != 200 or r.json()["choices"][0]["finish_reason"] not in ("stop", "length"):
        tally.failed.append(f"request {i}: {r.status_code} {r.text[:200]}")
        return
    tally.latencies.append(time.perf_counter() - start)
    tally.completion_tokens += r.json()["usage"]["completion_tokens"]


async def run(args: argparse.Namespace) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.clients)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=args.timeout, limits=limits) as client:
        if args.model is None:
            models = await client.get("/v1/models")
            if models.status_code != 200:  # e.g. 401: the server wants an --api-key
                raise SystemExit(f"GET /v1/models: {models.status_code} {models.text[:200]}")
            args.model = models.json()["data"][0]["id"]
        tally, next_index = Tally(), iter(range(args.requests))

        async def worker() -> None:  # one client: its requests back to back
            for i in next_index:
                await one_request(client, args, i, tally)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.clients)))
        elapsed = time.perf_counter() - start
    done = len(tally.latencies)
    q = statistics.quantiles(tally.latencies, n=100, method="inclusive") if done > 1 else [float("nan")] * 99
    return {
        "clients": args.clients,
        "requests": args.requests,
        "ok": done,
        "failed": len(tally.failed),
        "lost": len(tally.lost),
        "seconds": round(elapsed, 2),
        "requests_per_s": round(done / elapsed, 3),
        "generated_tokens_per_s": round(tally.completion_tokens / elapsed, 1),
        "latency_p50_s": round(q[49], 3),
        "latency_p99_s": round(q[98], 3),
        "errors": (tally.failed + tally.lost)[:5],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--requests", type=int, default=256, help="total requests over all clients")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens per request")
    p.add_argument("--model", default=None, help="default: the server's model")
    p.add_argument("--api-key", default=None)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a request counts as lost")
    print(json.dumps(asyncio.run(run(p.parse_args())), indent=2))


if __name__ == "__main__":
    main()
