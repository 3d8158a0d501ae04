"""`blockspec generate|chat|serve|bench|train`."""

import argparse
import dataclasses
import os
import socket
import sys
import time

from blockspec.config import SWITCH_WORDS, SpeculativeConfig
from blockspec.llm import AUTO, LLM, free_device_memory, resolve_speculative_config
from blockspec.outputs import RequestOutput
from blockspec.sampling import SamplingParams

GREEN, RESET = "\033[42m\033[30m", "\033[0m"


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF model directory or .gguf file (default: embedded SmolLM2)")
    p.add_argument(
        "--draft",
        default=AUTO,
        help="DFlash drafter directory, 'ngram' (prompt lookup) or 'none' (plain decoding); default 'auto': the "
        "shipped drafter with the embedded default model, plain decoding with any other --model",
    )
    width = p.add_mutually_exclusive_group()  # one number: block size = drafts + 1
    width.add_argument("--num-speculative-tokens", type=int, default=None, help="drafts per step (block width - 1)")
    width.add_argument("--block-size", type=int, default=None, help="block width (num_speculative_tokens + 1)")
    p.add_argument("--device", default=None)
    p.add_argument(
        "--dtype", default="auto", help="auto (bfloat16 on CUDA and CPUs with native bf16, else float32), float32, ..."
    )
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument(
        "--row-invariant",
        choices=SWITCH_WORDS,
        default="off",
        help="on: each row's numbers independent of the batch, so a greedy request's output is the same alone or in "
        "any batch and equals plain decoding (slower: docs/benchmarks.md)",
    )
    p.add_argument(
        "--warm-up",
        choices=SWITCH_WORDS,
        default="on",
        help="on: capture every CUDA graph and compile the prefill's kernels at start, so that no request waits on "
        "them (off: a quicker start, the first requests slower)",
    )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=None)


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig | None:
    """The drafter the flags ask for (None: plain decoding), its block as --num-speculative-tokens
    or --block-size say; ValueError where they set a block and there is no drafter."""
    spec = resolve_speculative_config(None if args.draft == "none" else args.draft, args.model)
    n = args.num_speculative_tokens if args.block_size is None else args.block_size - 1
    if spec is None and n is not None:
        raise ValueError(
            "--num-speculative-tokens and --block-size set a drafter's block, and there is no drafter (--draft "
            "none, or auto with a --model other than the embedded one): give --draft"
        )
    return spec if n is None else dataclasses.replace(spec, num_speculative_tokens=n)  # validated again


def build_llm(args: argparse.Namespace, spec: SpeculativeConfig | None) -> LLM:
    return LLM(
        args.model,
        spec,
        args.device,
        args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        row_invariant=SWITCH_WORDS[args.row_invariant],
        warm_up=SWITCH_WORDS[args.warm_up],
    )


def sampling_params(args: argparse.Namespace, **extra) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        max_tokens=args.max_tokens,
        seed=args.seed,
        **extra,
    )


def marked_text(llm: LLM, out: RequestOutput) -> str:
    """The output's text with each step's accepted drafts highlighted (the bonus token is plain).
    A step's boundary is the length of its prefix's decode, less a partial character at its end
    (a token can end inside one), so the marks never change the text (nor a stop token's text,
    left out of it, come back)."""
    ids, text = out.outputs[0].token_ids, out.outputs[0].text

    def boundary(num_tokens: int) -> int:
        return len(llm.tokenizer.decode(ids[:num_tokens], skip_special_tokens=True).rstrip("\ufffd"))

    pieces, start, end = [], 0, 0
    for n in out.metrics.acceptance_lengths:  # after the step's drafts, then after its bonus token
        drafted = max(start, boundary(end + n - 1))
        end += n
        stepped = max(drafted, boundary(end))
        pieces += [GREEN + text[start:drafted] + RESET if drafted > start else "", text[drafted:stepped]]
        start = stepped
    return "".join(pieces) + text[start:]


def timed(llm: LLM, prompt: str, params: SamplingParams) -> tuple[RequestOutput, float]:
    """The output and its decoding seconds, after a short warm-up request (graph captures and kernel
    compiles land there, not in the time)."""
    llm.generate(prompt, dataclasses.replace(params, max_tokens=min(8, params.max_tokens or 8)))
    start = time.perf_counter()
    out = llm.generate(prompt, params)[0]
    return out, time.perf_counter() - start


def generate(args: argparse.Namespace) -> None:
    spec = speculative_config(args)
    if (args.compare or args.show_drafts) and spec is None:
        raise ValueError(
            "--compare and --show-drafts are about a drafter's work, and there is no drafter: give --draft"
        )
    start = time.perf_counter()
    llm = build_llm(args, spec)
    loaded = time.perf_counter() - start
    prompt = llm.chat_prompt([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    params = sampling_params(args, return_drafts=args.show_drafts)
    out, elapsed = timed(llm, prompt, params)
    print(marked_text(llm, out) if args.show_drafts else out.outputs[0].text)
    n = len(out.outputs[0].token_ids)
    summary = f"{n} tokens, {n / elapsed:.1f} tok/s decoding (load {loaded:.1f} s)"
    if llm.engine.proposer is not None:
        summary += f", mean acceptance length {out.metrics.mean_acceptance_length:.2f}"
    if args.compare:
        del llm  # its weights and KV pages: a second engine must fit beside nothing
        free_device_memory()
        plain = LLM(args.model, None, args.device, args.dtype, max_model_len=args.max_model_len)
        plain_out, plain_elapsed = timed(plain, prompt, params)
        plain_rate = len(plain_out.outputs[0].token_ids) / plain_elapsed
        summary += f", {n / elapsed / plain_rate:.2f}x plain decoding ({plain_rate:.1f} tok/s)"
    print(f"[{summary}, finish: {out.outputs[0].finish_reason}]", file=sys.stderr)


def chat(args: argparse.Namespace) -> None:
    llm = build_llm(args, speculative_config(args))
    history = []
    while True:
        try:
            user = input("> ")
        except EOFError:
            return
        message = {"role": "user", "content": user}
        try:
            reply = chat_turn(llm, [*history, message], sampling_params(args))
        except ValueError as e:  # a conversation grown past the context: this turn is dropped, not the session
            print(f"blockspec: error: {e} (this message was not sent)", file=sys.stderr)
            continue
        history += [message, {"role": "assistant", "content": reply}]


def chat_turn(llm: LLM, messages: list[dict], params: SamplingParams) -> str:
    """The reply to `messages`, printed as it streams."""
    printed = ""
    for out in llm.stream(llm.chat_prompt(messages), params):
        text = out.outputs[0].text
        print(text[len(printed) :], end="", flush=True)
        printed = text
    print()
    return printed


def check_address(host: str, port: int) -> None:
    """ValueError where the server could not listen at host:port (a port out of range or in use, a
    host that does not resolve), found by binding a socket there as uvicorn will."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {port}")
    try:
        family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn's: a closed port's wait is no use
            probe.bind(address)
    except OSError as e:
        raise ValueError(f"cannot listen at {host}:{port} ({e.strerror or e})") from None


def serve(args: argparse.Namespace) -> None:
    """Load the engine, then serve it until interrupted."""
    try:
        from blockspec.server.api import serve as run_server  # fastapi and uvicorn only for this command
    except ModuleNotFoundError as e:  # reported as bad input is (`main`)
        raise ValueError(f"serve needs the server's packages, and {e.name} is missing: pip install 'blockspec[serve]'")

    api_key = args.api_key if args.api_key is not None else os.environ.get("BLOCKSPEC_API_KEY")  # out of `ps`
    if api_key is not None and not api_key.strip():
        raise ValueError("the API key is empty, which would let anyone in: give a key, or none to serve without")
    if args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    check_address(args.host, args.port)  # before the model loads
    llm = build_llm(args, speculative_config(args))
    name = args.served_model_name or args.model or llm.engine.target.name
    run_server(llm, name, args.host, args.port, api_key, args.max_request_bytes)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="blockspec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="apply the chat template")
    gen.add_argument("--show-drafts", action="store_true", help="highlight the tokens each step's draft got accepted")
    gen.add_argument(
        "--compare", action="store_true", help="also decode the prompt without speculation and report the speedup"
    )
    ch = sub.add_parser("chat", help="interactive chat")
    for p in (gen, ch):
        add_engine_args(p)
        add_sampling_args(p)
    gen.set_defaults(func=generate)
    ch.set_defaults(func=chat)
    from blockspec import train  # the trainer's flags come from its TrainConfig

    tr = sub.add_parser("train", help="train a DFlash, DSpark or DFlash2 drafter for a target on its own responses")
    train.add_train_args(tr)
    tr.set_defaults(func=train.main)
    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(srv)
    srv.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or set BLOCKSPEC_API_KEY)")
    srv.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    srv.add_argument("--max-request-bytes", type=int, default=32 * 2**20, help="larger request bodies get a 413")
    srv.set_defaults(func=serve)
    from blockspec.bench import bench

    bn = sub.add_parser("bench", help="decoding throughput: speculative vs plain, against the weight-read floor")
    bench.add_arguments(bn)
    bn.set_defaults(func=bench.run)
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as e:  # bad input (checkpoints, flags, prompts): no traceback
        parser.exit(2, f"blockspec: error: {e}\n")


if __name__ == "__main__":
    main()
