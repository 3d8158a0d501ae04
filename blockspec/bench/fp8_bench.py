"""Micro-benchmark of the linears on CUDA: bf16 F.linear (cuBLAS), bf16 `linear` (the models'
path: the Triton skinny kernel up to 16 rows at these shapes, cuBLAS above; under row invariance, column
"invariant µs", the MMA kernel at every M, `linear.invariant_linear`), and Fp8Linear's two W8A8
paths (the activations quantized per row by `quantize_rows`, then the Triton skinny kernel on FP8
tensor cores, its path up to FP8_SKINNY_MAX_M rows, or `torch._scaled_mm`, above), at the shapes of the
Qwen3-8B DFlash drafter (hidden 4096, intermediate 12288, q 4096, kv 1024, 5 layers, fc over 5
target layers) and of the LM head (151936 x 4096).

Each figure is device time per call from a CUDA graph of back-to-back calls (no launch overhead,
as under the engine's graphs); the calls cycle through enough copies of the weight (>= 256 MB) that
it is read from HBM, not from the 60 MB L2. GB/s counts the bytes a call must move (weight +
scales + x + y). `err` is max |skinny - _scaled_mm| / max |bf16 output| (two orders of the same
FP8 sums), `q-err` max |_scaled_mm - bf16| / max |bf16 output| (the quantization error). The last
lines add up one drafter step's linears, every GEMM at the same M.

    python -m blockspec.bench.fp8_bench                        # M in {1, 16, 256}
    python -m blockspec.bench.fp8_bench --m 16 64 128 256      # also where the paths should switch
    python -m blockspec.bench.fp8_bench --layout split                # q/k/v, gate/up as separate linears
    python -m blockspec.bench.fp8_bench --sweep --shapes qkv_proj o_proj --m 16   # skinny tile sweep
"""

import argparse
import dataclasses
import itertools
import math

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

from blockspec.bench.bench import copy_bandwidth
from blockspec.bench.timing import time_us
from blockspec.layers.kernels import num_sms
from blockspec.layers.kernels.quantize_rows import quantize_rows
from blockspec.layers.kernels.skinny_linear import SkinnyConfig, choose_config, skinny_scaled_mm
from blockspec.layers.linear import invariant_linear, linear
from blockspec.layers.quantization import FP8_SKINNY_MAX_M, Fp8Linear, quantize_weight

LAYERS = 5
# name: (N, K, calls per drafter step). The decoder layers either fuse q|k|v and gate|up into one
# linear each (`--layout fused`, blockspec's models) or keep them apart (`--layout split`, HF's).
COMMON = {
    "down_proj": (4096, 12288, LAYERS),
    "fc": (4096, 5 * 4096, 1),
    "fused_kv": (2 * LAYERS * 1024, 4096, 1),
    "lm_head": (151936, 4096, 1),
}
LAYOUTS = {
    "fused": {
        "qkv_proj": (4096 + 2 * 1024, 4096, LAYERS),
        "o_proj": (4096, 4096, LAYERS),
        "gate_up_proj": (2 * 12288, 4096, LAYERS),
        **COMMON,
    },
    "split": {
        "q,o_proj": (4096, 4096, 2 * LAYERS),
        "k,v_proj": (1024, 4096, 2 * LAYERS),
        "gate,up_proj": (12288, 4096, 2 * LAYERS),
        **COMMON,
    },
}
SHAPES = {**LAYOUTS["fused"], **LAYOUTS["split"]}
FLUSH_BYTES = 256 * 2**20


def describe(c: SkinnyConfig) -> str:
    return f"{c.block_m}x{c.block_n}x{c.block_k} s{c.split_k} w{c.num_warps} st{c.num_stages}"


def w8a8_skinny(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, cfg: SkinnyConfig | None) -> torch.Tensor:
    """Fp8Linear's skinny path with a chosen tile config."""
    qx, sx = quantize_rows(x)
    return skinny_scaled_mm(qx, sx, q, scale, x.dtype, config=cfg)


def sweep_configs(M: int, N: int, K: int) -> list[SkinnyConfig]:
    base = choose_config(M, N, K, num_sms(torch.device("cuda"), 0), 1)
    out = []
    if M <= 64:
        grid = itertools.product((64, 128), (128, 256), (1, 2, 4), (4,), (3, 4))
    else:
        grid = itertools.product((64, 128), (64, 128), (1, 2), (4, 8), (3, 4))
    for bn, bk, split, warps, stages in grid:
        k_steps = math.ceil(K / bk)
        if k_steps % split or k_steps // split < 2:
            continue
        out.append(SkinnyConfig(base.block_m, bn, bk, split, warps, stages))
    if M > 64:
        out += [dataclasses.replace(c, block_m=64) for c in out if c.block_m == 128]
    return out


@torch.inference_mode()  # the models' fast paths run without grad
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16, 256], help="rows (batch x block rows)")
    ap.add_argument("--layout", choices=list(LAYOUTS), default="fused", help="the decoder layers' linears")
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), help="default: every shape of --layout")
    ap.add_argument("--calls", type=int, default=32, help="calls per CUDA graph (at least the weight copies)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--sweep", action="store_true", help="also time a grid of tile configs (slow: compiles each)")
    ap.add_argument("--top", type=int, default=3, help="sweep: configs printed per case")
    args = ap.parse_args()
    shapes = args.shapes or list(LAYOUTS[args.layout])

    dev = torch.device("cuda")
    sms = num_sms(dev, 0)
    bw = copy_bandwidth(torch.device("cuda")) / 1e9
    print(f"{torch.cuda.get_device_name()}  {sms} SMs  torch {torch.__version__}  copy {bw:.0f} GB/s (r+w)")
    print(f"Fp8Linear: W8A8, the skinny kernel for M <= {FP8_SKINNY_MAX_M}, _scaled_mm above\n")
    head = (
        f"{'shape':<13} {'M':>5} {'N':>6} {'K':>6} | {'bf16 µs':>8} {'GB/s':>5} {'linear µs':>9} {'invariant µs':>12}"
    )
    head += f" | {'skinny µs':>9} {'GB/s':>5} {'config':<22} | {'scaled_mm µs':>12} | {'fp8 vs bf16':>11}"
    print(head + f" | {'err':>7} {'q-err':>6}")
    totals: dict[int, dict[str, float]] = {}  # M -> column -> µs of one drafter step
    for name in shapes:
        N, K, per_step = SHAPES[name]
        gen = torch.Generator(device=dev).manual_seed(0)
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
        q, scale = quantize_weight(w)
        n_bf16 = max(1, min(args.calls, math.ceil(FLUSH_BYTES / w.nbytes)))
        n_fp8 = max(1, min(args.calls, math.ceil(FLUSH_BYTES / q.nbytes)))
        ws = [w] + [w.clone() for _ in range(n_bf16 - 1)]
        qs = [(q, scale)] + [(q.clone(), scale.clone()) for _ in range(n_fp8 - 1)]
        layers = [Fp8Linear.from_quantized(*p) for p in qs]
        calls = max(args.calls, n_bf16, n_fp8)
        for M in args.m:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, generator=gen)
            act = 2 * M * (K + N)
            cfg = choose_config(M, N, K, sms, 1)
            y_bf16 = F.linear(x, w)
            top = y_bf16.float().abs().max().item()
            y_mm = layers[0].forward_w8a8(x, None, False, None, skinny=False)
            err = (w8a8_skinny(x, q, scale, cfg).float() - y_mm.float()).abs().max().item() / top
            qerr = (y_mm.float() - y_bf16.float()).abs().max().item() / top
            t_bf16 = time_us([lambda w=w_, x=x: F.linear(x, w) for w_ in ws], calls, args.reps)
            t_linear = time_us([lambda w=w_, x=x: linear(x, w) for w_ in ws], calls, args.reps)
            t_inv = time_us(
                [lambda w=w_, x=x: invariant_linear(x, w, None, None, False, None) for w_ in ws], calls, args.reps
            )
            t_sk = time_us([lambda p=p, x=x, c=cfg: w8a8_skinny(x, *p, c) for p in qs], calls, args.reps)
            t_mm = time_us(
                [lambda m=m, x=x: m.forward_w8a8(x, None, False, None, skinny=False) for m in layers], calls, args.reps
            )
            t_fp8 = t_sk if M <= FP8_SKINNY_MAX_M else t_mm
            gb_bf16 = (w.nbytes + act) / t_bf16 / 1e3
            gb_sk = (q.nbytes + scale.nbytes + act) / t_sk / 1e3
            line = f"{name:<13} {M:>5} {N:>6} {K:>6} | {t_bf16:>8.1f} {gb_bf16:>5.0f} {t_linear:>9.1f} {t_inv:>12.1f}"
            line += f" | {t_sk:>9.1f} {gb_sk:>5.0f} {describe(cfg):<22} | {t_mm:>12.1f} | {t_bf16 / t_fp8:>10.2f}x"
            print(line + f" | {err:>7.1e} {qerr:>6.3f}", flush=True)
            times = {"bf16": t_bf16, "linear": t_linear, "invariant": t_inv, "skinny": t_sk, "mm": t_mm}
            row = totals.setdefault(M, dict.fromkeys(times, 0.0))
            for column, t in times.items():
                row[column] += per_step * t
            if args.sweep:
                results = []
                for c in sweep_configs(M, N, K):
                    try:
                        w8a8_skinny(x, q, scale, c)
                        results.append(
                            (time_us([lambda p=p, c=c, x=x: w8a8_skinny(x, *p, c) for p in qs], calls, 3), c)
                        )
                    except (OutOfResources, RuntimeError) as e:  # too much shared memory, ...
                        print(f"    {describe(c)}: {type(e).__name__}")
                results.sort(key=lambda r: r[0])
                for us, c in results[: args.top]:
                    gb = (q.nbytes + scale.nbytes + act) / us / 1e3
                    print(f"    sweep {describe(c):<22} {us:>8.1f} µs {gb:>5.0f} GB/s")
        del ws, qs, layers, w, q, scale
        torch.cuda.empty_cache()
    if set(shapes) == set(LAYOUTS[args.layout]):
        print(f"\ndrafter linears per step ({args.layout}: 5 layers + fc + fused K/V + LM head, every GEMM at M):")
        for M, t in totals.items():
            fp8 = t["skinny"] if M <= FP8_SKINNY_MAX_M else t["mm"]
            print(
                f"  M={M:>5}: bf16 cuBLAS {t['bf16']:>8.1f} µs   bf16 linear {t['linear']:>8.1f} µs"
                f"   invariant {t['invariant']:>8.1f} µs   W8A8 skinny {t['skinny']:>8.1f} µs"
                f"   W8A8 _scaled_mm {t['mm']:>8.1f} µs   Fp8Linear {fp8:>8.1f} µs ({t['bf16'] / fp8:.2f}x)"
            )


if __name__ == "__main__":
    main()
