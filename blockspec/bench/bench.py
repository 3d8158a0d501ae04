"""`blockspec bench`: decoding throughput of the engine, speculative vs plain, in one run.

Per batch size: tok/s of plain decoding and of speculative decoding on the same engine, the
step time split into drafter, target verify, acceptance, context commit and the rest (host, and
the gaps between steps), from events recorded inside the step (`PhaseMarks`), and the weight-read
floor (weight bytes read per step, the context K/V its attention layers read, and the recurrent
states of linear-attention layers read and written once, / device copy bandwidth measured in this
run). `--prompt-len` takes several lengths: each is a set of rows (long contexts). With random
weights, `--simulate-tau` sets the acceptance pattern (`proposers.simulated`); the output says so.
`--temperature` > 0 times sampled decoding."""

import argparse
import itertools
import json
import time
from dataclasses import asdict, dataclass, field

import torch

from blockspec.bench.kernels import KernelTime, kernel_times
from blockspec.bench.meta import run_meta
from blockspec.bench.presets import is_preset, random_drafter, random_target
from blockspec.config import SWITCH_WORDS, EngineConfig, KernelConfig, SpeculativeConfig
from blockspec.engine.adaptive import RUN_AHEAD_RUN, first_run_length, width_classes
from blockspec.engine.engine import LLMEngine
from blockspec.engine.kv_cache import kv_token_bytes, state_bytes
from blockspec.layers.fast_path import use_kernels
from blockspec.layers.moe import SparseMoE
from blockspec.llm import free_device_memory, resolve_device, resolve_dtype
from blockspec.loading.drafters import load_drafter
from blockspec.loading.finish import drafter_options, target_options
from blockspec.loading.hf import load_target
from blockspec.sampling import SamplingParams

# each from the mark before it (`step_forward`); rollback: the linear-attention states' replay
PHASES = ("drafter", "verify", "accept", "rollback", "context")
PHASE_STEPS = 10


@dataclass
class Result:
    mode: str  # "plain", or the drafter's proposer ("dflash", "dspark")
    batch_size: int
    temperature: float
    tok_per_s: float
    step_ms: float
    tau: float
    phases_ms: dict[str, float] = field(default_factory=dict)  # drafter / verify / context / host
    floor_ms: float = 0.0
    tau_histogram: dict[int, int] = field(default_factory=dict)
    experts_per_layer: float = 0.0  # MoE targets: experts a step reads per MoE layer, on average
    context: float = 0.0  # tokens of context a sequence holds, averaged over the timed steps
    kernels: dict[str, KernelTime] = field(default_factory=dict)  # --kernel-profile: device time by kernel


class PhaseMarks:
    """A step's phase boundaries (`ModelRunner.mark`), as CUDA events recorded inside the step, in its
    CUDA graph too (external events: a replay records them), or host clock readings on the CPU. Each
    mark is one event, so read them (`phases`) after each step, before the next one replays."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.events = {} if cuda else None
        self.times: dict[str, float] = {}

    def record(self, name: str) -> None:
        if not self.cuda:
            self.times[name] = time.perf_counter() * 1e3
            return
        if name not in self.events:
            self.events[name] = torch.cuda.Event(enable_timing=True, external=True)
        self.events[name].record()

    def phases(self) -> dict[str, float]:
        """Milliseconds from each mark to the next, of the last step."""
        names = ("start", *PHASES)
        if not self.cuda:
            return {b: self.times[b] - self.times[a] for a, b in itertools.pairwise(names)}
        torch.cuda.synchronize()
        return {b: self.events[a].elapsed_time(self.events[b]) for a, b in itertools.pairwise(names)}


def copy_bandwidth(device: torch.device, nbytes: int = 2**31) -> float:
    """Bytes per second of a device-to-device copy, read + write counted: the best of 5 rounds (a
    single round once read half the bandwidth, which doubled the floor of that run)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best, reps = float("inf"), 10
    for _ in range(5):
        sync(device)
        start = time.perf_counter()
        for _ in range(reps):
            dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes * reps / best


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def weight_bytes(target, drafter) -> int:
    """Bytes read per step: every target weight (MoE: every expert) but the embedding table (only
    B*S rows are read), plus the drafter's weights and, again, the target's LM head that it uses."""

    def size(tensors):
        return sum(t.numel() * t.element_size() for t in tensors)

    embed = target.model.embed_tokens.weight
    tied = target.lm_head.weight is embed
    total = size(p for p in target.parameters() if p is not embed) + (size([embed]) if tied else 0)
    total += size(b for moe in moe_layers(target) for b in moe.experts.buffers())  # MXFP4 experts
    if drafter is not None:  # FP8 weights and scales are buffers; the FP8 LM head copy replaces the target's
        total += size(drafter.parameters()) + size(b for n, b in drafter.named_buffers() if "rotary" not in n)
        total += size([drafter.fused_kv_weight]) if drafter.fused_kv_weight is not None else 0  # context GEMM
        total += 0 if getattr(drafter, "lm_head_fp8", None) is not None else size([target.lm_head.weight])
    return total


def kv_bytes(model, context: float, element_size: int) -> float:
    """Bytes of context K/V one sequence's step reads from `model`'s paged layers (a sliding layer
    reads its window)."""
    sizes = kv_token_bytes(model.layers, element_size)
    window = min(context, model.sliding_window) if model.sliding_window is not None else context
    return sum(n * (window if t == "sliding_attention" else context) for t, n in sizes.items())


def moe_layers(target) -> list[SparseMoE]:
    return [m for m in target.modules() if isinstance(m, SparseMoE)]


def expert_bytes(moe: SparseMoE) -> int:
    """Bytes of one expert of `moe` (weights and biases; MXFP4 blocks and scales)."""
    tensors = [*moe.experts.parameters(), *moe.experts.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors) // moe.spec.num_experts


def count_experts(target) -> None:
    """Make the target's MoE layers record the experts they route to (`SparseMoE.touched`: one index
    write per layer in the step, captured in its graphs)."""
    for moe in moe_layers(target):
        moe.touched = torch.zeros(moe.spec.num_experts, dtype=torch.bool, device=moe.router.weight.device)


def touched_expert_bytes(target) -> tuple[int, int]:
    """Bytes of the experts the MoE layers routed to since the last call, and how many they were;
    clears the record."""
    layers = moe_layers(target)
    counts = torch.stack([moe.touched.sum() for moe in layers]).tolist()  # one copy to the host, not one a layer
    for moe in layers:
        moe.touched.zero_()
    return sum(n * expert_bytes(moe) for n, moe in zip(counts, layers)), sum(counts)


def total_steps(steps: int, warmup: int, profiled: bool) -> int:
    """Steps a measurement runs: warmup, the timed steps, then PHASE_STEPS read one by one and,
    `profiled` (--kernel-profile), PHASE_STEPS more."""
    return warmup + steps + (2 if profiled else 1) * PHASE_STEPS


def run_steps(engine: LLMEngine, steps: int) -> float:
    """Seconds that `steps` engine steps take, device work included."""
    sync(engine.device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(engine.device)
    return time.perf_counter() - start


def measure(engine: LLMEngine, batch: int, prompt_len: int, args, warmup: int, marks: PhaseMarks) -> dict:
    """Step time as the engine runs; the drafter / verify / accept / context split from PHASE_STEPS
    more steps, each read before the next launches (the marks of a step are overwritten by the
    next), and the rest (host, and the gaps between steps) as the step time less those."""
    gen = torch.Generator().manual_seed(batch)
    max_tokens = engine.max_model_len - prompt_len - engine.max_width  # none finishes (run_mode sizes it)
    # Seeded, so that a simulated acceptance, of (seed, position), is the same every run; but not
    # sampled requests under adaptive width, which a seed would hold at the full block (its output
    # reproducible: `LLMEngine.step_widths`)
    seeded = args.temperature == 0 or not args.adaptive_width
    for i in range(batch):
        params = SamplingParams(
            temperature=args.temperature, max_tokens=max_tokens, ignore_eos=True, seed=i if seeded else None
        )
        engine.add_request(torch.randint(0, engine.vocab_size - 1, (prompt_len,), generator=gen).tolist(), params)
    # Every prompt prefilled first (admission takes max_num_batched_tokens of prompts a step), then
    # the warmup: graph captures, adaptive exploration. No prefill falls in the timed steps.
    while engine.scheduler.waiting or any(s.needs_prefill for s in engine.scheduler.running):
        engine.step()
    run_steps(engine, warmup)
    seqs = list(engine.scheduler.running)
    before = [len(s.acceptance_lengths) for s in seqs]
    cached = sum(s.num_cached for s in seqs)
    elapsed = run_steps(engine, args.steps)
    context = (cached + sum(s.num_cached for s in seqs)) / 2 / len(seqs)
    taus = [a for s, n in zip(seqs, before) for a in s.acceptance_lengths[n:]]
    run_ahead, engine.run_ahead = engine.run_ahead, False
    run_steps(engine, 1)  # completes the step in flight
    totals = dict.fromkeys(PHASES, 0.0)
    touched = [0, 0]
    moe = bool(moe_layers(engine.target.model))
    if moe:
        touched_expert_bytes(engine.target.model)
    for _ in range(PHASE_STEPS):
        run_steps(engine, 1)
        for name, ms in marks.phases().items():
            totals[name] += ms
        if moe:  # one step's experts
            touched = [a + b for a, b in zip(touched, touched_expert_bytes(engine.target.model))]
    # in lock step too: no step is left in flight when the sequences are aborted
    kernels = kernel_times(engine.step, PHASE_STEPS, marks.cuda) if args.kernel_profile else {}
    engine.run_ahead = run_ahead
    phases = {k: v / PHASE_STEPS for k, v in totals.items()}
    phases["host"] = max(0.0, elapsed * 1e3 / args.steps - sum(phases.values()))
    for s in seqs:
        engine.abort(s.request_id)
    experts = {"expert_bytes": touched[0] / PHASE_STEPS, "experts": touched[1] / PHASE_STEPS}
    timed = {"tokens": sum(taus), "elapsed": elapsed, "taus": taus, "phases": phases, "context": context}
    return timed | experts | {"kernels": kernels}


def run_mode(target, drafter, args, batch: int, prompt_len: int, bandwidth: float, cuda: bool) -> Result:
    spec = (
        SpeculativeConfig(
            num_speculative_tokens=args.block_size - 1,
            fp8=args.fp8,
            adaptive_width=args.adaptive_width,
            simulate_tau=args.simulate_tau,
            deferred_context=args.deferred_context,
        )
        if drafter is not None
        else None
    )
    # Adaptive width explores its widths before it settles: where steps run ahead, a first run of each
    # (a step to capture its graphs on CUDA, SAMPLES to time it, two at its ends whose time is not its own).
    first_runs = first_run_length(RUN_AHEAD_RUN) * len(width_classes(args.block_size))
    warmup = args.warmup + (first_runs if args.adaptive_width and drafter else 0)
    # Admission takes max_num_batched_tokens of prompts a step: the first admitted decode meanwhile
    admission = -(-batch * prompt_len // EngineConfig.max_num_batched_tokens)
    max_len = prompt_len + (total_steps(args.steps, warmup + admission, args.kernel_profile) + 8) * args.block_size
    config = EngineConfig(
        max_num_seqs=batch,
        max_model_len=max_len,
        cuda_graphs=not args.no_cuda_graphs,
        async_steps=False if args.lock_step else None,
        num_pages=batch * (-(-max_len // 16) + 2) + 1,
        row_invariant=SWITCH_WORDS[args.row_invariant],
        warm_up=False,  # graphs hold the phase marks in place when they are captured: `measure` warms up
    )
    engine = LLMEngine(target, drafter, spec, config)
    marks = engine.runner.phase_marks = PhaseMarks(cuda)  # before any step: graphs capture the marks
    count_experts(target.model)  # as the marks
    m = measure(engine, batch, prompt_len, args, warmup, marks)
    step_ms = m["elapsed"] * 1e3 / args.steps
    hist = {}
    for t in m["taus"]:
        hist[t] = hist.get(t, 0) + 1
    # MoE: the floor reads only the experts a step routes to (measured over the phase steps)
    layers = moe_layers(target.model)
    all_experts = sum(expert_bytes(moe) * moe.spec.num_experts for moe in layers)
    # Linear attention: each sequence's recurrent state is read and written once a step too
    element_size = target.model.lm_head.weight.element_size()
    states = 2 * batch * state_bytes(target.model.layers, element_size)
    # Attention reads each sequence's context K/V, the target's and the drafter's
    models = [target.model] + ([drafter] if drafter is not None else [])
    kv = batch * sum(kv_bytes(model, m["context"], element_size) for model in models)
    floor_ms = (weight_bytes(target.model, drafter) - all_experts + m["expert_bytes"] + states + kv) / bandwidth * 1e3
    del engine
    free_device_memory()
    return Result(
        drafter.proposer if drafter is not None else "plain",
        batch,
        args.temperature,
        m["tokens"] / m["elapsed"],
        step_ms,
        sum(m["taus"]) / max(1, len(m["taus"])),
        m["phases"],
        floor_ms,
        dict(sorted(hist.items())),
        m["experts"] / len(layers) if layers else 0.0,
        m["context"],
        m["kernels"],
    )


def load(args, device, dtype):
    """The target and drafter, ready as `LLM` loads them (kernels in force first: the options read them)."""
    use_kernels(KernelConfig(cpu_packed=SWITCH_WORDS[args.cpu_packed]))
    options = target_options(None, device, args.mxfp4_experts)
    target = (
        random_target(args.model, dtype, device, options)
        if is_preset(args.model)
        else load_target(args.model, dtype, device, options)
    )
    if args.draft is None:
        return target, None
    options = drafter_options(
        SpeculativeConfig(fp8=args.fp8, cpu_bf16=args.cpu_bf16), device, target.model.spec.hidden_size, dtype
    )
    if is_preset(args.draft):
        return target, random_drafter(args.draft, target.model, dtype, device, options)
    return target, load_drafter(args.draft, target.model, dtype, device, options)


def report(results: list[Result], bandwidth: float, simulated: bool) -> None:
    print(
        f"copy bandwidth {bandwidth / 1e12:.2f} TB/s" + ("; acceptance SIMULATED (random weights)" if simulated else "")
    )
    print(
        f"{'mode':7} {'batch':>5} {'T':>4} {'tok/s':>9} {'step ms':>8} {'floor ms':>8} {'x floor':>7} {'tau':>5} "
        + " ".join(f"{p:>8}" for p in (*PHASES, "host"))
    )
    for r in results:
        print(
            f"{r.mode:7} {r.batch_size:5d} {r.temperature:4.2g} {r.tok_per_s:9.1f} {r.step_ms:8.2f} {r.floor_ms:8.2f} "
            f"{r.step_ms / r.floor_ms:7.2f} {r.tau:5.2f} "
            + " ".join(f"{r.phases_ms[p]:8.3f}" for p in (*PHASES, "host"))
        )


def plot(results: list[Result], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG written")
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for mode in dict.fromkeys(r.mode for r in results):
        rs = [r for r in results if r.mode == mode]
        a.plot([r.batch_size for r in rs], [r.tok_per_s for r in rs], marker="o", label=mode)
    a.set(xscale="log", xlabel="batch size", ylabel="tok/s", title="throughput")
    a.legend()
    spec = [r for r in results if r.mode != "plain"]
    if spec:
        hist = spec[0].tau_histogram
        b.bar(list(hist), list(hist.values()))
        b.set(xlabel="tokens per step (tau)", ylabel="steps", title=f"tau histogram, batch {spec[0].batch_size}")
    fig.tight_layout()
    fig.savefig(path)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="random:Qwen3-8B", help="target directory or random:<preset>")
    p.add_argument("--draft", default="random:Qwen3-8B-DFlash-b16", help="drafter directory, random:<preset> or none")
    p.add_argument("--batch-sizes", default="1,4,16,64")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prompt-len", default="512", help="prompt tokens of every request; several: 4096,16384")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--simulate-tau", type=float, default=None, help="force this mean acceptance length")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of every request")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument(
        "--lock-step", action="store_true", help="read each step before launching the next (no launch ahead)"
    )
    p.add_argument(
        "--adaptive-width", action="store_true", help="let steps narrow the block (default: every step at full width)"
    )
    p.add_argument(
        "--deferred-context",
        type=int,
        default=SpeculativeConfig.deferred_context,
        help="SpeculativeConfig.deferred_context: positions a width-1 step may defer the drafter's context of (0: none)",
    )
    p.add_argument(
        "--row-invariant",
        choices=SWITCH_WORDS,
        default="off",
        help="EngineConfig.row_invariant",
    )
    p.add_argument(
        "--kernel-profile",
        action="store_true",
        help="also record each kernel's device time per step (CPU: each op's), over a few steps under torch.profiler",
    )
    add_load_arguments(p)
    p.add_argument("--out", default="bench.json")


def add_load_arguments(p: argparse.ArgumentParser) -> None:
    """The options `load` reads besides --model and --draft (the arrival bench loads through it too)."""
    p.add_argument(
        "--fp8",
        default="auto",
        help="FP8 drafter: on, off, auto (the engine's default: on for Hopper+ and drafters of hidden size >= 2048)",
    )
    p.add_argument(
        "--mxfp4-experts",
        action="store_true",
        help="keep an MXFP4 target's experts in MXFP4 (EngineConfig.mxfp4_experts)",
    )
    p.add_argument(
        "--cpu-packed",
        choices=SWITCH_WORDS,
        default="on",
        help="KernelConfig.cpu_packed: the CPU's linears on weights packed at load",
    )
    add_cpu_bf16_argument(p)


def add_cpu_bf16_argument(p: argparse.ArgumentParser) -> None:
    """--cpu-bf16, as `SpeculativeConfig.cpu_bf16` reads it (the acceptance bench takes it too)."""
    p.add_argument(
        "--cpu-bf16",
        choices=("auto", *SWITCH_WORDS),
        default="off",
        help="SpeculativeConfig.cpu_bf16: a float32 engine's drafter on bf16 packed copies on the CPU",
    )


def run_sizes(args: argparse.Namespace) -> tuple[list[int], list[int]]:
    """The run's prompt lengths and batch sizes; ValueError naming a flag the run could not go on
    with, before anything loads."""
    if args.steps < 1 or args.warmup < 0:
        raise ValueError(f"--steps must be >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}")
    if args.block_size < 2:
        raise ValueError(f"--block-size must be >= 2 (the anchor and a draft), got {args.block_size}")
    try:
        prompt_lens, batches = ([int(n) for n in flag.split(",")] for flag in (args.prompt_len, args.batch_sizes))
    except ValueError:
        raise ValueError("--prompt-len and --batch-sizes are integers separated by commas") from None
    if min(prompt_lens + batches) < 1:
        raise ValueError("--prompt-len and --batch-sizes must be >= 1")
    return prompt_lens, batches


def run(args: argparse.Namespace) -> None:
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    args.draft = None if args.draft == "none" else args.draft
    prompt_lens, batches = run_sizes(args)
    target, drafter = load(args, device, dtype)
    bandwidth = copy_bandwidth(device)
    meta = run_meta(
        "blockspec.bench.bench", device, dtype, model=args.model, draft=args.draft, bandwidth_Bps=bandwidth,
        simulated_tau=args.simulate_tau, cpu_packed=args.cpu_packed, cpu_bf16=args.cpu_bf16,
        adaptive_width=args.adaptive_width, deferred_context=args.deferred_context, row_invariant=args.row_invariant,
    )  # fmt: skip
    results = []
    for prompt_len in prompt_lens:
        for batch in batches:
            for d in (None, drafter) if drafter is not None else (None,):
                results.append(run_mode(target, d, args, batch, prompt_len, bandwidth, device.type == "cuda"))
                with open(args.out, "w") as f:  # after each row: a failure later keeps the rows measured
                    json.dump({"meta": meta, "results": [asdict(r) for r in results]}, f, indent=2)
    report(results, bandwidth, args.simulate_tau is not None)
    plot(results, args.out.removesuffix(".json") + ".png")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m blockspec.bench.bench", description=__doc__)
    add_arguments(parser)
    run(parser.parse_args())
