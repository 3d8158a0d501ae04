"""Micro-benchmark of the linears on CUDA: bf16 F.linear (cuBLAS), bf16 `linear` (the models'
path: the Triton skinny kernel up to 16 rows, cuBLAS above), and Fp8Linear's two CUDA paths: the
weight-only Triton kernel (its path up to 16 rows) and W8A8 (above: the activations quantized per
row by `quantize_rows`, then `torch._scaled_mm` on FP8 tensor cores), at the shapes of the
Qwen3-8B DFlash drafter (hidden 4096, intermediate 12288, q 4096, kv 1024, 5 layers, fc over 5 target layers)
and of the LM head (151936 x 4096).

Each figure is device time per call from a CUDA graph of back-to-back calls (no launch overhead,
as under the engine's graphs); the calls cycle through enough copies of the weight (>= 256 MB) that
it is read from HBM, not from the 60 MB L2. GB/s counts the bytes a call must move (weight +
scales + x + y). `err` is max |fp8 kernel - fp8 reference| / max |reference|, and `q-err` and
`w8a8-err` the same for the weight-only kernel and W8A8 against bf16 (the quantization error).
The last lines add up one drafter step's linears, every GEMM at the same M.

    python -m blockspec.bench.fp8_bench                        # M in {1, 16, 256}
    python -m blockspec.bench.fp8_bench --m 1 16 256 1024      # also where large M should switch
    python -m blockspec.bench.fp8_bench --layout split                # q/k/v, gate/up as separate linears
    python -m blockspec.bench.fp8_bench --sweep --shapes qkv_proj o_proj --m 16   # tile sweep
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
from blockspec.layers.kernels.skinny_linear import SkinnyConfig, choose_config, dequantize_fp8, skinny_linear
from blockspec.layers.linear import LINEAR_MAX_M, linear
from blockspec.layers.quantization import Fp8Linear, quantize_weight

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


def sweep_configs(M: int, N: int, K: int) -> list[SkinnyConfig]:
    base = choose_config(M, N, K, num_sms(torch.device("cuda"), 0))
    out = []
    if M <= 64:
        grid = itertools.product((32, 64, 128), (128, 256), (1, 2, 4, 8, 16), (4,), (3, 4, 5))
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
    print(f"Fp8Linear: weight-only Triton kernel for M <= {LINEAR_MAX_M}, W8A8 (_scaled_mm) above\n")
    head = f"{'shape':<13} {'M':>5} {'N':>6} {'K':>6} | {'bf16 µs':>8} {'GB/s':>5} {'linear µs':>9}"
    head += f" | {'fp8 µs':>8} {'GB/s':>5}"
    head += f" {'vs bf16':>7} {'config':<22} | {'w8a8 µs':>8} | {'err':>7} {'q-err':>6} {'w8a8-err':>8}"
    print(head)
    totals: dict[int, list[float]] = {}
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
            cfg = choose_config(M, N, K, sms)
            y_bf16 = F.linear(x, w)
            y_fp8 = skinny_linear(x, q, scale, None, cfg)
            y_ref = F.linear(x, dequantize_fp8(q, scale, torch.bfloat16))
            denom = y_ref.float().abs().max().item()
            err = (y_fp8.float() - y_ref.float()).abs().max().item() / denom
            top = y_bf16.float().abs().max().item()
            qerr = (y_fp8.float() - y_bf16.float()).abs().max().item() / top
            y_w8a8 = layers[0].forward_scaled_mm(x, None, False, None)
            w8a8_err = (y_w8a8.float() - y_bf16.float()).abs().max().item() / top
            t_bf16 = time_us([lambda w=w_, x=x: F.linear(x, w) for w_ in ws], calls, args.reps)
            t_linear = time_us([lambda w=w_, x=x: linear(x, w) for w_ in ws], calls, args.reps)
            t_fp8 = time_us([lambda p=p, x=x, c=cfg: skinny_linear(x, *p, None, c) for p in qs], calls, args.reps)
            t_w8a8 = time_us(
                [lambda m=m, x=x: m.forward_scaled_mm(x, None, False, None) for m in layers], calls, args.reps
            )
            gb_bf16 = (w.nbytes + act) / t_bf16 / 1e3
            gb_fp8 = (q.nbytes + scale.nbytes + act) / t_fp8 / 1e3
            line = f"{name:<13} {M:>5} {N:>6} {K:>6} | {t_bf16:>8.1f} {gb_bf16:>5.0f} {t_linear:>9.1f}"
            line += f" | {t_fp8:>8.1f} {gb_fp8:>5.0f}"
            line += f" {t_bf16 / t_fp8:>6.2f}x {describe(cfg):<22} | {t_w8a8:>8.1f}"
            line += f" | {err:>7.1e} {qerr:>6.3f} {w8a8_err:>8.3f}"
            print(line, flush=True)
            fp8_best = t_fp8 if M <= LINEAR_MAX_M else t_w8a8
            row = totals.setdefault(M, [0.0, 0.0, 0.0, 0.0])
            row[0] += per_step * t_bf16
            row[1] += per_step * t_linear
            row[2] += per_step * fp8_best
            row[3] += per_step * min(t_fp8, t_w8a8)
            if args.sweep:
                results = []
                for c in sweep_configs(M, N, K):
                    try:
                        skinny_linear(x, q, scale, None, c)
                        results.append(
                            (time_us([lambda p=p, c=c, x=x: skinny_linear(x, *p, None, c) for p in qs], calls, 3), c)
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
        for M, (b, lin, f, best) in totals.items():
            print(
                f"  M={M:>5}: bf16 cuBLAS {b:>8.1f} µs   bf16 linear {lin:>8.1f} µs   fp8 {f:>8.1f} µs ({b / f:.2f}x)"
                f"   best of fp8 paths {best:>8.1f} µs"
            )


if __name__ == "__main__":
    main()
