"""Micro-benchmark of an MoE layer's experts on CUDA: the Triton kernel (`fused_moe_triton`) at the
geometry of the MoE presets, against the bytes of the experts its rows route to.

Each figure is device time per call, from CUDA graphs of --calls back-to-back calls (as in the
engine's step graphs), for rows routed by a random router (`route`), and the bandwidth that the
touched experts' bytes imply. `--sweep` also times other tiles for both GEMMs, to choose the table
in `blockspec.layers.kernels.fused_moe`.

    python -m blockspec.bench.moe_bench                    # T in {1, 16, 64, 256}
    python -m blockspec.bench.moe_bench --sweep --rows 1 16
"""

import argparse
import itertools

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

from blockspec.bench.presets import TARGETS, preset
from blockspec.bench.timing import time_us
from blockspec.layers.kernels.fused_moe import MoEConfig, choose_block_m, fused_moe_triton
from blockspec.layers.moe import MoESpec, route
from blockspec.models.registry import family_for

MODELS = ("Qwen3-Coder-30B-A3B", "gpt-oss-20b")  # MoE presets (`blockspec.bench.presets`)


def moe_layer(name: str) -> tuple[int, MoESpec]:
    """A preset's hidden size and experts."""
    config = preset(TARGETS, f"random:{name}")
    spec = family_for(config).layer_spec(config)
    return spec.hidden_size, spec.moe


def make_inputs(H: int, m: MoESpec, rows: int, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    kw = {"device": "cuda", "dtype": torch.bfloat16}
    x = torch.randn(rows, H, **kw)
    weights, ids = route(F.linear(x, torch.randn(m.num_experts, H, **kw) * H**-0.5), m)
    bias = m.expert_bias
    return {
        "x": x,
        "weights": weights,
        "ids": ids,
        "gate_up": torch.randn(m.num_experts, 2 * m.intermediate_size, H, **kw) * H**-0.5,
        "down": torch.randn(m.num_experts, H, m.intermediate_size, **kw) * m.intermediate_size**-0.5,
        "gate_up_bias": torch.randn(m.num_experts, 2 * m.intermediate_size, **kw) if bias else None,
        "down_bias": torch.randn(m.num_experts, H, **kw) if bias else None,
        "m": m,
    }


def touched_bytes(x: dict) -> int:
    """Bytes of the experts the rows route to (weights and biases)."""
    tensors = [x[n] for n in ("gate_up", "down", "gate_up_bias", "down_bias") if x[n] is not None]
    return x["ids"].unique().numel() * sum(t[0].numel() * t.element_size() for t in tensors)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--sweep", action="store_true", help="also time other tiles (block_n, block_k, stages)")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(
        f"{'model':>20} {'T':>5} {'experts':>7} {'µs':>8} {'GB/s':>6}"
        + ("  sweep: bn/bk/stages=µs" if args.sweep else "")
    )
    for name in args.models:
        H, m = moe_layer(name)
        for rows in args.rows:
            x = make_inputs(H, m, rows)
            us = time_us([lambda x=x: fused_moe_triton(**x)], args.calls, args.reps)
            nbytes = touched_bytes(x)
            line = f"{name:>20} {rows:>5} {x['ids'].unique().numel():>7} {us:>8.1f} {nbytes / us / 1e3:>6.0f}"
            if args.sweep:
                bm = choose_block_m(rows * m.top_k, m.num_experts)
                for bn, bk, stages in itertools.product((32, 64, 128), (64, 128, 256), (3, 5)):
                    cfg = MoEConfig(bm, bn, bk, 4, stages)
                    try:
                        t = time_us([lambda x=x, cfg=cfg: fused_moe_triton(**x, config=cfg)], args.calls, args.reps)
                    except OutOfResources:  # the tiles' pipeline does not fit shared memory
                        continue
                    line += f" {bn}/{bk}/{stages}={t:.0f}"
            print(line, flush=True)
            del x
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
