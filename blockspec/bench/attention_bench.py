"""Micro-benchmark of paged attention on CUDA: the Triton kernel vs `paged_attention_ref`.

Qwen3-8B head geometry (32 query / 8 kv heads, head_dim 128), bf16, page_size 16, pages
shuffled over the pool, block tables padded to --max-len (as under the engine's CUDA graphs).
Each figure is device time per call, from CUDA graphs of --calls back-to-back calls (so no
launch overhead, as in the engine), with the K/V bandwidth it implies.

    python -m blockspec.bench.attention_bench              # B in {1,16,64} x S in {1,16} x ctx {512,2048}
    python -m blockspec.bench.attention_bench --sweep      # also every forced split count
"""

import argparse

import torch

from blockspec.bench.timing import time_us
from blockspec.layers.attention import paged_attention_ref
from blockspec.layers.kernels import num_sms
from blockspec.layers.kernels.paged_attention import default_splits, paged_attention_triton

HQ, HKV, D, PAGE = 32, 8, 128, 16


def make_inputs(batch: int, rows: int, ctx: int, max_len: int, kind: str, seed: int = 0) -> dict:
    """Sequence b has ctx positions, the last `rows` of them being the query rows."""
    torch.manual_seed(seed)
    pages = -(-ctx // PAGE)
    M = max(pages, -(-max_len // PAGE))
    pool = torch.randperm(batch * pages).cuda() + 1
    block_tables = torch.zeros(batch, M, dtype=torch.long, device="cuda")
    block_tables[:, :pages] = pool.view(batch, pages)
    slots = (batch * pages + 1) * PAGE
    kw = {"device": "cuda", "dtype": torch.bfloat16}
    pos = (ctx - rows + torch.arange(rows, device="cuda")).expand(batch, rows)
    if kind == "causal":  # target verify
        k_start, k_end = torch.zeros_like(pos), pos + 1
    else:  # drafter block: everything, for every row
        k_start, k_end = torch.zeros_like(pos), torch.full_like(pos, ctx)
    return {
        "q": torch.randn(batch, rows, HQ, D, **kw),
        "k_cache": torch.randn(slots, HKV, D, **kw),
        "v_cache": torch.randn(slots, HKV, D, **kw),
        "block_tables": block_tables,
        "k_start": k_start.contiguous(),
        "k_end": k_end.contiguous(),
        "page_size": PAGE,
        "scale": D**-0.5,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--ctx", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--max-len", type=int, default=4096, help="block tables padded to this many positions")
    ap.add_argument("--kind", choices=["causal", "block"], default="causal")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--sweep", action="store_true", help="also time forced split counts 1..32")
    ap.add_argument("--no-ref", action="store_true", help="skip the reference (slow and memory-hungry)")
    args = ap.parse_args()

    sms = num_sms(torch.device("cuda"), 0)
    print(f"{torch.cuda.get_device_name()}  {sms} SMs  torch {torch.__version__}  kind={args.kind}")
    head = f"{'B':>3} {'S':>3} {'ctx':>5} {'split':>5} {'triton µs':>10} {'GB/s':>6}"
    head += f" {'ref µs':>9} {'speedup':>7} {'max err':>8}"
    print(head + ("  sweep: splits=µs" if args.sweep else ""))
    for batch in args.batch:
        for rows in args.rows:
            for ctx in args.ctx:
                x = make_inputs(batch, rows, ctx, args.max_len, args.kind)
                splits = default_splits(x["q"], x["k_cache"], x["block_tables"], PAGE)
                out = paged_attention_triton(**x)
                ours = time_us([lambda x=x: paged_attention_triton(**x)], args.calls, args.reps)
                kv_bytes = 2 * batch * ctx * HKV * D * 2
                line = f"{batch:>3} {rows:>3} {ctx:>5} {splits:>5} {ours:>10.1f} {kv_bytes / ours / 1e3:>6.0f}"
                if args.no_ref:
                    line += f" {'-':>9} {'-':>7} {'-':>8}"
                else:
                    ref = paged_attention_ref(**x)
                    err = (out.float() - ref.float()).abs().max().item()
                    ref_us = time_us([lambda x=x: paged_attention_ref(**x)], args.calls, args.reps)
                    line += f" {ref_us:>9.1f} {ref_us / ours:>6.1f}x {err:>8.4f}"
                if args.sweep:
                    line += " "
                    for n in (1, 2, 4, 8, 16, 32):
                        us = time_us(
                            [lambda x=x, n=n: paged_attention_triton(**x, num_splits=n)], args.calls, args.reps
                        )
                        line += f" {n}={us:.1f}"
                print(line, flush=True)
                del x
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
