"""CPU linears on weights packed once, at load, into oneDNN's blocked layout. `F.linear` on the
CPU lays its weight out anew on every call (MKL's fp32 GEMM packs it above two rows; oneDNN's bf16
GEMM reorders it into AMX tiles), and for the few rows of a decode, verify or propose step that
copy is a large part of the GEMM's time. Packed once, it is not made again. fp32 at one or two rows
is measured (`measure_min_rows`, once a process, on the first model large enough): on Intel's CPUs
`F.linear`'s GEMV-like path reads the weight faster than the packed GEMM there; on AMD's it is far
slower (MKL does not take its fast paths there), and the packed GEMM serves every row count.

The packed copy sits beside the weight (a `Linear`'s `packed`), made last at load
(`loading.finish`): nothing changes the weight afterwards. It costs one more copy of each linear's
weight in memory. `KernelConfig.cpu_packed` off makes no copies at load and leaves any made
unused. A float32 engine's drafter may hold bfloat16 copies (`SpeculativeConfig.cpu_bf16`): its
float32 rows are rounded to bf16 on the way in and its outputs come back in float32.

Under row invariance a copy serves whole calls where oneDNN keeps a row's bits: its GEMM on a packed
weight computes each row in the same order at any number of rows from two, in float32 and, on the
AVX512-BF16 CPUs measured, in bf16, and at some shapes a lone float32 row too (at others it takes
another path, so it is padded to two: on the EPYC measured, weights of K 1536 or 2304 but not 576; a
lone bf16 row always is, its rounding hiding most of a path's differences). That is a property of
oneDNN's kernels, not a promise, so `kept_rows` checks it on this CPU, once per weight shape, dtype
and thread count (set the threads before the engine starts), over calls of up to INVARIANT_CALL_ROWS
rows, and larger calls are split into calls of that many.
A copy that fails the check serves `row_invariant.tiled_linear`'s fixed tiles of rows instead."""

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from blockspec.layers.fast_path import active_kernels


@dataclass(frozen=True)
class KeptRows:
    """What `kept_rows` found of oneDNN's GEMM on one packed weight's shape, dtype and threads."""

    from_two: bool  # a row keeps its bits in calls of 2 to INVARIANT_CALL_ROWS rows, at any offset
    lone: bool  # and in a call of its own


# Rows from which the packed GEMM beats F.linear, per dtype, where fp32's is not measured
MIN_ROWS = {torch.float32: 3, torch.bfloat16: 1}
# fp32 rows below MIN_ROWS go to the packed GEMM where it is this much faster there (a clear
# margin, so that the choice, and the rounding of those rows, does not flip from run to run)
MEASURE_MARGIN = 1.15
# A model's fp32 weights `measure_min_rows` streams (more than a last-level cache holds), and the
# least it measures on: a tiny model's GEMMs time overheads, not weight reads
MEASURE_BYTES, MEASURE_MIN_BYTES = 64 * 2**20, 16 * 2**20
MEASURE_REPEATS = 3
_min_rows: dict[int, int] = {}  # threads -> the fp32 rows from which the packed GEMM serves
# Rows of a oneDNN call at most, under row invariance: the calls `kept_rows` checks go up to it
INVARIANT_CALL_ROWS = 128
# Row counts whose rows `kept_rows` compares with the same rows of one call of INVARIANT_CALL_ROWS
CHECK_ROWS = (1, 2, 3, 4, 5, 8, 15, 16, 17, 33, 64, 100)
LONE_ROWS = (0, 1, 5, 77)  # rows that `kept_rows` runs alone
# Batches of INVARIANT_CALL_ROWS random rows `kept_rows` tries, per dtype. A bf16 output's rounding
# hides most of another order of summation, so a GEMM that rounds a rare output apart by the row
# count (oneDNN's bf16 GEMM on an AMX Xeon) may pass one batch: docs/design.md, row invariance
CHECK_BATCHES = {torch.float32: 1, torch.bfloat16: 16}
_checked: dict[tuple, KeptRows] = {}  # (N, K, dtype, threads) -> what `kept_rows` found


def packing_supported(device: torch.device) -> bool:
    """The CPU with torch's oneDNN and the switch on."""
    return device.type == "cpu" and torch.backends.mkldnn.is_available() and active_kernels().cpu_packed


def bf16_supported() -> bool:
    """oneDNN runs bf16 GEMMs here (and packs their weights): natively, or emulated on AVX-512."""
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


def native_cpu_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX): there bf16 GEMMs are faster
    than fp32."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def pack(weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """oneDNN's packed copy of a [N, K] weight, in `dtype` (None: the weight's); None for a dtype it
    is not used for, or bf16 on a CPU without bf16 instructions (oneDNN refuses to pack it there)."""
    dtype = dtype or weight.dtype
    if dtype not in MIN_ROWS or (dtype == torch.bfloat16 and not bf16_supported()):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype))


def min_rows(dtype: torch.dtype) -> int:
    """Rows from which a copy of `dtype` serves a linear: fp32's as measured at these threads."""
    return _min_rows.get(torch.get_num_threads(), MIN_ROWS[dtype]) if dtype == torch.float32 else MIN_ROWS[dtype]


def measure_min_rows(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Time F.linear against the packed GEMM at one and two rows over (fp32 weight, packed copy)
    pairs, up to MEASURE_BYTES of them, and keep for this process's threads the fewest rows from
    which the packed GEMM is MEASURE_MARGIN faster at every count (else MIN_ROWS). Once a thread
    count; a model of fewer than MEASURE_MIN_BYTES leaves it unmeasured."""
    threads = torch.get_num_threads()
    if threads in _min_rows:
        return
    chosen, total = [], 0
    for weight, packed in pairs:
        if total >= MEASURE_BYTES:
            break
        chosen.append((weight, packed))
        total += weight.numel() * weight.element_size()
    if total < MEASURE_MIN_BYTES:
        return
    rows = MIN_ROWS[torch.float32]
    for m in (2, 1):  # packed at one row needs packed at two
        if pass_seconds(chosen, m, packed=True) * MEASURE_MARGIN > pass_seconds(chosen, m, packed=False):
            break
        rows = m
    _min_rows[threads] = rows


def pass_seconds(pairs: list[tuple[torch.Tensor, torch.Tensor]], m: int, packed: bool) -> float:
    """The fastest of MEASURE_REPEATS passes of m random rows through every pair's GEMM."""
    inputs = {w.shape[1]: torch.randn(m, w.shape[1]) for w, _ in pairs}
    best = float("inf")
    with torch.no_grad():
        for _ in range(MEASURE_REPEATS):
            start = time.perf_counter()
            for w, p in pairs:
                x = inputs[w.shape[1]]
                onednn_gemm(x, p) if packed else F.linear(x, w)
            best = min(best, time.perf_counter() - start)
    return best


def onednn_gemm(rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """rows [M, K] times a packed [N, K] weight (plus bias) in one oneDNN call."""
    return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")


def kept_rows(packed: torch.Tensor) -> KeptRows:
    """Whether oneDNN's GEMM on a packed [N, K] weight, at this process's threads, gives each row the
    same bits at every row count of CHECK_ROWS and at an offset as in one call of INVARIANT_CALL_ROWS
    (CHECK_BATCHES batches of random rows in the copy's dtype), and whether a lone float32 row does
    too (at some shapes it takes another path: `invariant_gemm` then pads it); found once per shape,
    dtype and threads."""
    key = (*packed.shape, packed.dtype, torch.get_num_threads())
    if key not in _checked:
        gen = torch.Generator().manual_seed(0)
        shape = (INVARIANT_CALL_ROWS, packed.shape[1])
        batches = [torch.randn(shape, generator=gen).to(packed.dtype) for _ in range(CHECK_BATCHES[packed.dtype])]
        from_two = all(rows_kept(x, packed) for x in batches)
        # bf16: rounding the outputs hides most of another path's differences (12 of 128 rows differ
        # alone at K 1536 on the EPYC measured), so a lone bf16 row is always padded
        lone = from_two and packed.dtype == torch.float32 and lone_rows_kept(batches[0], packed)
        _checked[key] = KeptRows(from_two, lone)
    return _checked[key]


def rows_kept(x: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether the first rows of x ([INVARIANT_CALL_ROWS, K]) at each count of CHECK_ROWS, and rows at
    an offset, come out of the packed GEMM with the bits they have in one call of all of x."""
    whole = onednn_gemm(x, packed)
    parts = [(x[:m], whole[:m]) for m in CHECK_ROWS] + [(x[7:40], whole[7:40])]
    return all(torch.equal(_gemm_calls(rows, packed, pad_lone=True), want) for rows, want in parts)


def lone_rows_kept(x: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether rows LONE_ROWS of x, each in a call of its own, keep the bits they have in one call of x."""
    whole = onednn_gemm(x, packed)
    return all(torch.equal(onednn_gemm(x[i : i + 1], packed), whole[i : i + 1]) for i in LONE_ROWS)


def invariant_rows(packed: torch.Tensor) -> bool:
    """Whether a packed copy serves whole calls under row invariance (`kept_rows`' from_two)."""
    return kept_rows(packed).from_two


def invariant_gemm(rows: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """rows [M, K] times a packed weight in calls of at most INVARIANT_CALL_ROWS rows, a lone row
    padded with a zero row where oneDNN's GEMM takes another path for it (`kept_rows`)."""
    return _gemm_calls(rows, packed, pad_lone=not kept_rows(packed).lone)


def _gemm_calls(rows: torch.Tensor, packed: torch.Tensor, pad_lone: bool) -> torch.Tensor:
    if rows.shape[0] > INVARIANT_CALL_ROWS:
        return torch.cat([_gemm_calls(part, packed, pad_lone) for part in rows.split(INVARIANT_CALL_ROWS)])
    if pad_lone and rows.shape[0] == 1:
        return onednn_gemm(F.pad(rows, (0, 0, 0, 1)), packed)[:1]
    return onednn_gemm(rows, packed)


def usable(x: torch.Tensor, packed: torch.Tensor | None) -> bool:
    """Whether a packed copy can serve a linear of x: on the CPU, without grad, the switch on, x in
    the copy's dtype (or float32 rows on a bf16 copy)."""
    return (
        packed is not None
        and x.device.type == "cpu"
        and not torch.is_grad_enabled()
        and active_kernels().cpu_packed
        and (x.dtype == packed.dtype or (x.dtype == torch.float32 and packed.dtype == torch.bfloat16))
    )


def takes_packed(x: torch.Tensor, packed: torch.Tensor | None) -> bool:
    """Whether a linear of x runs in one call on its weight's packed copy: where the copy is
    `usable`, from the copy dtype's `min_rows`; under row invariance a copy whose rows oneDNN keeps
    (`invariant_rows`) at any rows, and no other."""
    if not usable(x, packed):
        return False
    if active_kernels().row_invariant:
        return invariant_rows(packed)
    return x.numel() >= min_rows(packed.dtype) * x.shape[-1]


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) on the weight's packed copy (`pack`), in the copy's dtype; the
    result in x's. Under row invariance by `invariant_gemm`, the bias added after it."""
    rows = x.reshape(-1, x.shape[-1]).to(packed.dtype)
    bias = bias.to(packed.dtype) if bias is not None else None
    if active_kernels().row_invariant:
        y = invariant_gemm(rows, packed)
        y = y if bias is None else y + bias
    else:
        y = onednn_gemm(rows, packed, bias)
    return y.view(*x.shape[:-1], y.shape[-1]).to(x.dtype)
