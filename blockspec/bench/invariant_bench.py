"""What row invariance costs, op by op, on CUDA, with row invariance off and on
(`KernelConfig.row_invariant`); device µs per call from CUDA graphs (`timing.time_us`):
- a Qwen3-8B decoder layer's GEMMs (the engine's `linear`, with its fused norm, SwiGLU and
  residual) at the rows of a decode (1), a 16-row verify and 16 such sequences (256), each
  invariant GEMM checked to give row 0 the same bits at 256 rows as alone;
- its paged attention (batch 1, 16, 64; 1 or 16 query rows; 545 or 2048 positions) at the
  default splits and in each row-invariant layout given (keys a split, and the programs an SM
  from which each program folds its own splits).

    python -m blockspec.bench.invariant_bench
    python -m blockspec.bench.invariant_bench --layouts 256/2 512/0.5   # attention laid out otherwise
"""

import argparse
import dataclasses

import torch

from blockspec.bench.attention_bench import make_inputs
from blockspec.bench.timing import time_us
from blockspec.config import KernelConfig
from blockspec.layers.fast_path import active_kernels, restore_kernels
from blockspec.layers.kernels import paged_attention
from blockspec.layers.linear import linear
from blockspec.layers.norm import RMSNorm

HIDDEN, INTERMEDIATE, QKV = 4096, 12288, 6144  # Qwen3-8B: 32 query and 8 kv heads of 128
# name: (N, K, norm prologue, SwiGLU, residual)
GEMMS = {
    "qkv": (QKV, HIDDEN, True, False, False),
    "o": (HIDDEN, HIDDEN, False, False, True),
    "gate_up": (2 * INTERMEDIATE, HIDDEN, True, True, False),
    "down": (HIDDEN, INTERMEDIATE, False, False, True),
}
ROWS = (1, 16, 256)


def with_invariance(on: bool, fn):
    """fn() with row invariance `on`, the switches in force before restored after it."""
    before = active_kernels()
    restore_kernels(dataclasses.replace(before, row_invariant=on))
    try:
        return fn()
    finally:
        restore_kernels(before)


def gemm_rows(name: str, calls: int, reps: int) -> list[str]:
    N, K, norm, swiglu, residual = GEMMS[name]
    kw = {"device": "cuda", "dtype": torch.bfloat16}
    w = torch.randn(N, K, **kw) * 0.02
    x = torch.randn(max(ROWS), K, **kw)
    res = torch.randn(max(ROWS), N, **kw) if residual else None
    rms = RMSNorm(K, 1e-6).to(**kw) if norm else None

    def call(m: int) -> torch.Tensor:
        return linear(x[:m], w, None, rms, swiglu, None if res is None else res[:m])

    lines = []
    for m in ROWS:
        off = with_invariance(False, lambda m=m: time_us([lambda: call(m)], calls, reps))
        on = with_invariance(True, lambda m=m: time_us([lambda: call(m)], calls, reps))
        lines.append(f"{name:>8} {m:>4} {off:>9.1f} {on:>9.1f} {on / off:>6.2f}x")
    same = with_invariance(True, lambda: torch.equal(call(max(ROWS))[:1], call(1)))
    return [line + ("" if same else "  NOT ROW-INVARIANT") for line in lines]


# The row-invariant attention's layout (`paged_attention.invariant_launch`), as --layouts spells it
LAYOUT = ("INVARIANT_SPLIT_KEYS", "FOLD_PROGRAMS_PER_SM")


def layout(text: str) -> tuple[float, ...]:
    """KEYS/FOLD: keys a split, and the programs an SM from which each folds its own splits."""
    values = tuple(float(v) if "." in v else int(v) for v in text.split("/"))
    if len(values) != len(LAYOUT):
        raise argparse.ArgumentTypeError(f"{text!r}: a layout is KEYS/FOLD, e.g. 256/2")
    return values


def with_layout(values: tuple[float, ...], fn):
    """fn() with the row-invariant attention laid out as `values` (LAYOUT's constants), then as before."""
    before = [getattr(paged_attention, name) for name in LAYOUT]
    for name, value in zip(LAYOUT, values):
        setattr(paged_attention, name, value)
    try:
        return fn()
    finally:
        for name, value in zip(LAYOUT, before):
            setattr(paged_attention, name, value)


def attention_rows(layouts: list[tuple[float, ...]], calls: int, reps: int) -> list[str]:
    """Attention's µs off, then on at each layout."""
    lines = []
    for batch in (1, 16, 64):
        for rows in (1, 16):
            for ctx in (545, 2048):
                x = make_inputs(batch, rows, ctx, 4096, "causal")
                off = time_us([lambda x=x: paged_attention.paged_attention_triton(**x)], calls, reps)
                line = f"{batch:>3} {rows:>4} {ctx:>5} {off:>9.1f}"
                calls_on = [lambda x=x: paged_attention.paged_attention_triton(**x, invariant=True)]
                for values in layouts:
                    line += f" {with_layout(values, lambda c=calls_on: time_us(c, calls, reps)):>15.1f}"
                lines.append(line)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    shipped = "/".join(str(getattr(paged_attention, name)) for name in LAYOUT)
    ap.add_argument("--layouts", type=layout, nargs="+", default=[layout(shipped)], help=layout.__doc__)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    restore_kernels(KernelConfig())
    torch.set_grad_enabled(False)  # the fast paths run without grad
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  bf16, Qwen3-8B shapes, device µs per call")
    print(f"{'gemm':>8} {'rows':>4} {'off µs':>9} {'on µs':>9} {'on/off':>7}")
    for name in GEMMS:
        print("\n".join(gemm_rows(name, args.calls, args.reps)), flush=True)
    head = "".join(f" {'on@' + '/'.join(map(str, values)):>15}" for values in args.layouts)
    print(f"attention, µs (causal, block tables of 4096 positions; on@{'/'.join(LAYOUT)})")
    print(f"{'B':>3} {'rows':>4} {'ctx':>5} {'off':>9}{head}")
    print("\n".join(attention_rows(args.layouts, args.calls, args.reps)))


if __name__ == "__main__":
    main()
