"""Micro-benchmark of a verify's linear-attention recurrence and its rollback on CUDA, per Gated
DeltaNet layer at the geometry of the hybrid presets: the ways to leave each sequence's state at
the end of its accepted rows.

- `gathered`: fla's recurrent kernel on states gathered from the pool (fresh ones zeroed, gates of
  rows past a sequence masked), and at commit the same again over the accepted rows with the final
  states scattered back.
- `replay` (the engine's): `kernels.gated_delta` reading and writing the pool in place; the commit
  replays the accepted rows without outputs.
- `per-row`: the forward also stores the state after every row; the commit copies each sequence's
  state after its accepted rows into its slot.

Each figure is device µs per layer from CUDA graphs of as many back-to-back layers as the model
has linear-attention layers (`time_us`): the verify's forward alone, then forward and commit.
Acceptance is drawn uniformly over 1..T rows a sequence.

    python -m blockspec.bench.rollback_bench             # B in {1, 16, 64}, T = 16
"""

import argparse

import torch

from blockspec.bench.presets import TARGETS, preset
from blockspec.bench.timing import time_us
from blockspec.layers.gated_deltanet import LinearAttentionSpec, gated_delta_rule, masked
from blockspec.layers.kernels.gated_delta import recurrent_in_slots
from blockspec.layers.recurrent_state import RecurrentStates
from blockspec.models.registry import family_for

MODELS = ("Qwen3.5-27B", "Qwen3.6-35B-A3B")  # hybrid presets (`blockspec.bench.presets`)


def linear_attention(name: str) -> tuple[LinearAttentionSpec, int]:
    """A preset's Gated DeltaNet widths and how many of its layers are Gated DeltaNet."""
    config = preset(TARGETS, f"random:{name}")
    spec = family_for(config).layer_spec(config)
    return spec.linear_attention, sum(t == "linear_attention" for t in config.layer_types)


def make_inputs(la: LinearAttentionSpec, B: int, T: int, seed: int = 0) -> dict:
    """q, k, v as views of the convolution output [B, T, C] (as the layer has them), the gates,
    a pool of B + 1 slots (slot 0 the trash slot), and each sequence's accepted rows."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    conv = torch.randn(B, T, la.conv_dim, device="cuda", generator=gen).bfloat16()
    q, k, v = conv.split([la.key_dim, la.key_dim, la.value_dim], dim=-1)
    heads = (la.num_key_heads, la.num_key_heads, la.num_value_heads)
    q, k, v = (x.unflatten(-1, (h, -1)) for x, h in zip((q, k, v), heads))
    g = -torch.rand(B, T, la.num_value_heads, device="cuda", generator=gen)
    beta = torch.rand(B, T, la.num_value_heads, device="cuda", generator=gen).bfloat16()
    pool = torch.randn(B + 1, la.num_value_heads, la.key_head_dim, la.value_head_dim, device="cuda") * 0.1
    slots = torch.arange(1, B + 1, device="cuda")
    states = RecurrentStates(slots, torch.full_like(slots, 100), torch.full_like(slots, T))
    accepted = torch.randint(1, T + 1, (B,), device="cuda", generator=gen)
    row_states = torch.empty(B, T, *pool.shape[1:], device="cuda")
    return {"qkvgb": (q, k, v, g, beta), "pool": pool, "states": states, "accepted": accepted, "rows": row_states}


def gathered(x: dict, commit: bool) -> None:
    st, qkvgb = x["states"], x["qkvgb"]
    g, beta = masked(*qkvgb[3:], st.lengths)
    gated_delta_rule(*qkvgb[:3], g, beta, st.initial(x["pool"]), final=False)
    if commit:
        g, beta = masked(*qkvgb[3:], x["accepted"])
        _, final = gated_delta_rule(*qkvgb[:3], g, beta, st.initial(x["pool"]))
        x["pool"].index_copy_(0, st.slots, final)


def replay(x: dict, commit: bool) -> None:
    st, qkvgb, pool = x["states"], x["qkvgb"], x["pool"]
    recurrent_in_slots(*qkvgb, pool, st.slots, st.starts, st.lengths)
    if commit:
        recurrent_in_slots(*qkvgb, pool, st.slots, st.starts, x["accepted"], outputs=False, write=True)


def per_row(x: dict, commit: bool) -> None:
    st, qkvgb, pool = x["states"], x["qkvgb"], x["pool"]
    recurrent_in_slots(*qkvgb, pool, st.slots, st.starts, st.lengths, row_states=x["rows"])
    if commit:
        last = x["rows"][torch.arange(len(st.slots), device="cuda"), x["accepted"] - 1]
        pool.index_copy_(0, st.slots, last)


WAYS = {"gathered": gathered, "replay": replay, "per-row": per_row}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--rows", type=int, default=16, help="rows a sequence in the verify (the block width)")
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  T={args.rows}")
    print(f"{'model':>16} {'B':>3} {'layers':>6} " + " ".join(f"{w + ' fwd/+commit µs':>26}" for w in WAYS))
    with torch.inference_mode():
        for name in args.models:
            la, layers = linear_attention(name)
            for B in args.batch_sizes:
                x = make_inputs(la, B, args.rows)
                cells = []
                for way in WAYS.values():
                    fwd, both = (time_us([lambda w=way, x=x, c=c: w(x, c)], layers, args.reps) for c in (False, True))
                    cells.append(f"{fwd:>12.1f} / {both:>11.1f}")
                print(f"{name:>16} {B:>3} {layers:>6} " + " ".join(cells), flush=True)
                del x
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
