"""The Triton paged-attention kernel against `paged_attention_ref`.

With a GPU the kernel runs for real (bf16 and fp32). Without one it runs in Triton's
interpreter (fp32, small shapes), which must be switched on before triton is first imported,
and conftest's imports (transformers -> torch._dynamo) import it: so on CPU this file is run
again in a subprocess with TRITON_INTERPRET=1 (test_kernels_in_interpreter; by hand:
`TRITON_INTERPRET=1 python -m pytest tests/test_kernels_attention.py`). Skipped where triton
is not installed."""

import math

import pytest
import torch

pytest.importorskip("triton")

from conftest import CUDA, INTERPRETED, interpreter_test, make_drafter, make_target, runs_kernel

from blockspec import LLM, SamplingParams
from blockspec.layers import attention as attention_module
from blockspec.layers.attention import paged_attention, paged_attention_ref
from blockspec.layers.fast_path import reference_ops
from blockspec.layers.kernels import kernel_module
from blockspec.layers.kernels import paged_attention as paged_attention_module
from blockspec.layers.kernels.paged_attention import (
    ARRIVE_MAX_SPLITS,
    choose_splits,
    fuses_qkv,
    paged_attention_triton,
    qkv_attention_triton,
    step_grid,
)
from blockspec.layers.kernels.qk_norm_rope import layers_kv_write_triton, qk_norm_rope_triton
from blockspec.layers.kv_write import write_kv
from blockspec.layers.rotary import layers_kv_write, qk_norm_rope, qk_norm_rope_ref

test_kernels_in_interpreter = interpreter_test(__file__)


def _fix_interpreter_index() -> None:
    """Triton 3.6's interpreter turns a scalar into a Python int with int(array of shape (1,)),
    which numpy >= 2.4 refuses (loops with tensor bounds fail): triton-lang/triton#9171, fixed
    after 3.6. Convert with .item() instead."""
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor

    def patched(tensor, scope) -> None:
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patched


if INTERPRETED:
    _fix_interpreter_index()

DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.bfloat16, torch.float32] if CUDA else [torch.float32]


def make_case(
    starts: list[int],
    widths: list[int],
    heads: tuple[int, int],
    head_dim: int,
    page_size: int,
    kind: str,
    window: int | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> dict:
    """Batch tensors the way the runner builds them: sequence b has starts[b] cached positions
    and widths[b] real rows (padding rows sit at position 0); its pages are scattered over a
    shuffled pool and its block-table row is padded with the trash page 0."""
    gen = torch.Generator().manual_seed(seed)
    hq, hkv = heads
    B, S = len(starts), max(widths)
    num_pages = [-(-(st + w) // page_size) for st, w in zip(starts, widths)]
    M = max(num_pages) + 2
    pool = torch.randperm(sum(num_pages) + 3, generator=gen) + 1
    block_tables = torch.zeros(B, M, dtype=torch.long)
    taken = 0
    for b, n in enumerate(num_pages):
        block_tables[b, :n] = pool[taken : taken + n]
        taken += n
    slots = (len(pool) + 1) * page_size
    k_cache = torch.randn(slots, hkv, head_dim, generator=gen)
    v_cache = torch.randn(slots, hkv, head_dim, generator=gen)
    q = torch.randn(B, S, hq, head_dim, generator=gen)
    start, width = torch.tensor(starts), torch.tensor(widths)
    rows = torch.arange(S)
    pos = torch.where(rows < width[:, None], start[:, None] + rows, 0)
    if kind == "causal":  # target prefill/verify
        k_start = (pos - window + 1).clamp_min(0) if window else torch.zeros_like(pos)
        k_end = pos + 1
    else:  # drafter block: context (or its window) plus the whole block, for every row
        ctx = (start - window).clamp_min(0) if window else torch.zeros_like(start)
        k_start, k_end = ctx[:, None].expand(B, S), (start + width)[:, None].expand(B, S)
    to = {"device": DEVICE, "dtype": dtype}
    return {
        "q": q.to(**to),
        "k_cache": k_cache.to(**to),
        "v_cache": v_cache.to(**to),
        "block_tables": block_tables.to(DEVICE),
        "k_start": k_start.to(DEVICE),
        "k_end": k_end.to(DEVICE),
        "page_size": page_size,
        "scale": head_dim**-0.5,
    }


def reference(case: dict) -> torch.Tensor:
    """The oracle in fp32, from the same (possibly bf16) inputs."""
    up = {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in case.items()}
    return paged_attention_ref(**up)


def check(out: torch.Tensor, case: dict) -> None:
    assert out.shape == case["q"].shape and out.dtype == case["q"].dtype
    tol = 2e-2 if out.dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(out.float(), reference(case), atol=tol, rtol=tol)


# (starts, widths, (Hq, Hkv), D, page_size, kind, window)
CASES = {
    "decode_g4_d128": ([37, 5, 100], [1, 1, 1], (8, 2), 128, 16, "causal", None),
    "verify_g4_s16_ragged": ([50, 3], [16, 9], (4, 1), 128, 16, "causal", None),
    "verify_g4_s7_ragged": ([50, 3], [7, 5], (4, 1), 128, 16, "causal", None),  # 28 rows: a part-filled tile of 16
    "draft_block_g3_d64": ([70, 20], [16, 16], (6, 2), 64, 16, "block", None),
    "draft_block_window_g1": ([90, 33], [4, 4], (2, 2), 64, 8, "block", 24),
    "causal_window_g3_s5": ([41, 12], [5, 3], (3, 1), 64, 16, "causal", 20),
    "causal_window_3_s5": ([41, 12], [5, 3], (3, 1), 64, 16, "causal", 3),  # a window within the step's rows
    "prefill_three_tiles": ([0, 0], [40, 23], (4, 1), 64, 16, "causal", None),
    "head_dim_80_page_4": ([29], [2], (4, 2), 80, 4, "causal", None),
    "tiny_model_d16_page_4": ([45, 7], [8, 8], (4, 2), 16, 4, "block", None),
}


@runs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", CASES)
def test_matches_reference(name: str, dtype: torch.dtype) -> None:
    case = make_case(*CASES[name], dtype=dtype)
    check(paged_attention_triton(**case, num_splits=1), case)


@pytest.fixture
def poisoned_partials(monkeypatch) -> None:
    """Split-K's partial outputs start as NaN: every split the combine reads must write its partial
    of every row (zeros and an lse of -inf where it holds none of the row's keys), or the NaN
    reaches the output."""
    real = paged_attention_module._partials

    def poisoned(num_splits: int, out: torch.Tensor, d_pad: int, split: bool) -> tuple[torch.Tensor, torch.Tensor]:
        part, lse = real(num_splits, out, d_pad, split)
        return (part.fill_(float("nan")), lse) if split else (part, lse)

    monkeypatch.setattr(paged_attention_module, "_partials", poisoned)


@pytest.fixture
def arrivals(monkeypatch):
    """This test's split-K arrival counters (the last split of a tile to arrive combines), checked
    back at zero, ready for the next launch, once it ends."""
    monkeypatch.setattr(paged_attention_module, "_ARRIVALS", {})
    yield paged_attention_module._ARRIVALS
    for counters in paged_attention_module._ARRIVALS.values():
        assert not counters[-1].any()


@runs_kernel
@pytest.mark.parametrize("splits", [2, 3, 7])
@pytest.mark.parametrize("name", ["decode_g4_d128", "draft_block_g3_d64", "verify_g4_s16_ragged"])
def test_split_k_matches_reference(name: str, splits: int, poisoned_partials, arrivals) -> None:
    """Forced splits, including more splits than the short ranges fill (empty partials, over a
    workspace poisoned with NaN); up to ARRIVE_MAX_SPLITS combined by the last to arrive."""
    case = make_case(*CASES[name], dtype=DTYPES[0])
    check(paged_attention_triton(**case, num_splits=splits), case)
    assert (splits <= ARRIVE_MAX_SPLITS) == bool(arrivals)


@runs_kernel
def test_heuristic_splits_long_context_batch_one() -> None:
    case = make_case([300], [1], (4, 1), 64, 16, "causal", dtype=DTYPES[0])
    assert choose_splits(1, case["block_tables"].shape[1] * 16, 132) > 1
    check(paged_attention_triton(**case), case)


def test_choose_splits() -> None:
    assert choose_splits(512, 4096, 132) == 1  # B=64, 8 kv heads: the grid is full
    assert choose_splits(8, 64, 132) == 1  # too few keys to split
    assert choose_splits(8, 1024, 132) == 16  # B=1, 8 kv heads, 1k context: a split per 64 keys
    assert choose_splits(8, 2048, 132) == 32
    assert choose_splits(8, 1 << 20, 132) == 32  # capped at MAX_SPLITS (2 * 132 / 8 = 33)
    assert choose_splits(128, 2048, 132) == 3


def test_step_grid() -> None:
    """(rows a program, query tiles, key splits) of the fused step launch, Qwen3-8B heads (8 kv
    heads of 4 query heads) on 132 SMs."""
    assert step_grid(1, 8, 64, 1024, 132) == (16, 4, 12)  # B=1 verify: tiles of 16 rows, 3 programs an SM
    assert step_grid(1, 8, 64, 1536, 132) == (16, 4, 12)  # 24 splits of one tile become 12 of two at most
    assert step_grid(1, 8, 64, 4096, 132) == (64, 1, 32)  # ... and no further: one tile of 64 rows
    assert step_grid(4, 8, 64, 1024, 132) == (64, 1, 9)  # B=4: 16-row tiles would leave 3 splits
    assert step_grid(16, 8, 64, 1024, 132) == (64, 1, 3)
    assert step_grid(1, 8, 4, 1024, 132) == (16, 1, 16)  # decode: one tile of 4 rows, as before
    assert step_grid(16, 8, 4, 1024, 132) == (16, 1, 3)


@runs_kernel
def test_out_buffer() -> None:
    case = make_case(*CASES["decode_g4_d128"], dtype=DTYPES[0])
    out = torch.empty_like(case["q"])
    assert paged_attention_triton(**case, out=out) is out
    check(out, case)


# Sink logits of query heads 0, 1, ...: moderate ones, large ones that leave a head a tiny share
# (e^-25) or all of it, and ones past exp's float32 range (e^1e4: inf) that must neither overflow
# nor NaN: the head's output is then 0, or that without a sink.
SINKS = [1.5, -25.0, 25.0, 1e4, -1.0, -1e4, 4.0, 0.5]


def head_sinks(heads: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(SINKS[:heads], dtype=dtype, device=DEVICE)


def check_sinks(out: torch.Tensor, expected: torch.Tensor) -> None:
    """out against expected head by head, relative to the head's largest output: a large sink scales
    a head's outputs down by orders of magnitude, under any absolute tolerance."""
    tol = 2e-2 if out.dtype == torch.bfloat16 else 1e-4
    scale = expected.float().abs().amax(dim=(0, 1, 3), keepdim=True).clamp_min(1e-30)
    torch.testing.assert_close(out.float() / scale, expected.float() / scale, atol=tol, rtol=tol)


def assert_catches_wrong_sinks(expected: torch.Tensor, attend) -> None:
    """`check_sinks` fails the outputs of a kernel that ignores the sinks, or adds them to each
    split's partial (its log-sum-exp then holds the sink, and the combine counts it once a split:
    over two splits, the sink plus log 2). attend(sinks): the reference's output with those sinks."""
    sinks = expected.new_tensor(SINKS[: expected.shape[2]])
    for wrong in (attend(None), attend(sinks + math.log(2))):
        with pytest.raises(AssertionError):
            check_sinks(wrong, expected)


@runs_kernel
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize(
    "name",
    ["decode_g4_d128", "verify_g4_s16_ragged", "draft_block_window_g1", "prefill_three_tiles", "causal_window_g3_s5"],
)  # causal_window_g3_s5: 3 query heads, folded one row a program
def test_invariant_launch_matches_reference_and_gives_a_row_the_same_bits_alone(
    name: str, sinks: bool, monkeypatch, poisoned_partials, arrivals
) -> None:
    """Row invariance (`invariant_launch`): against the reference, keys split at fixed positions
    (small splits here, so that rows span several, some empty), and each real row of the batch the
    same bits as that row attending alone, as a decode step computes it."""
    monkeypatch.setattr(paged_attention_module, "INVARIANT_SPLIT_KEYS", 64)
    case = make_case(*CASES[name], dtype=DTYPES[0])
    batch, _, heads, head_dim = case["q"].shape
    splits = -(-case["block_tables"].shape[1] * case["page_size"] // 64)
    position_bytes = batch * heads * splits * ((1 << (head_dim - 1).bit_length()) + 1) * 4  # a position's partials
    monkeypatch.setattr(
        paged_attention_module, "INVARIANT_PARTIALS_BYTES", 12 * position_bytes
    )  # the prefill: 12 a launch
    case["sinks"] = head_sinks(case["q"].shape[2]) if sinks else None
    together = paged_attention_triton(**case, invariant=True)
    if sinks:
        check_sinks(together, reference(case))
    else:
        check(together, case)
    for b, s in (case["k_end"] > case["k_start"]).nonzero().tolist():
        row = {"q": case["q"][b : b + 1, s : s + 1], "block_tables": case["block_tables"][b : b + 1]}
        row |= {"k_start": case["k_start"][b : b + 1, s : s + 1], "k_end": case["k_end"][b : b + 1, s : s + 1]}
        alone = paged_attention_triton(**(case | row), invariant=True)
        assert torch.equal(alone[0, 0], together[b, s]), (b, s)


@runs_kernel
@pytest.mark.parametrize("name", ["decode_g4_d128", "verify_g4_s16_ragged"])
def test_invariant_launch_leaves_out_the_splits_past_a_tables_keys(name: str, monkeypatch, poisoned_partials, arrivals):
    """A CUDA graph's block tables span the context limit, most of their fixed splits past every row's
    keys: those write no partial (the workspace stays NaN, and a combine that read one would give
    NaN) and are not combined, and every row has the bits it has with a table as wide as its keys."""
    monkeypatch.setattr(paged_attention_module, "INVARIANT_SPLIT_KEYS", 64)
    case = make_case(*CASES[name], dtype=DTYPES[0])
    narrow = paged_attention_triton(**case, invariant=True)
    tables = case["block_tables"]
    wide = torch.cat([tables, torch.zeros_like(tables).repeat(1, 7)], 1)  # 8x the columns, the trash page
    assert torch.equal(paged_attention_triton(**(case | {"block_tables": wide}), invariant=True), narrow)


@runs_kernel
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("name", ["decode_g4_d128", "verify_g4_s16_ragged", "prefill_three_tiles"])
def test_invariant_launch_gives_the_same_bits_folded_in_one_program_as_split_across_programs(
    name: str, sinks: bool, monkeypatch, poisoned_partials, arrivals
) -> None:
    """Row invariance folds a tile's splits in its one program where the tiles alone fill the SMs
    (`invariant_folds`; a large batch), else runs them as programs of their own, which
    `_fold_kernel` folds: every row has the same bits either way, and the reference's values."""
    monkeypatch.setattr(paged_attention_module, "INVARIANT_SPLIT_KEYS", 64)
    case = make_case(*CASES[name], dtype=DTYPES[0])
    case["sinks"] = head_sinks(case["q"].shape[2]) if sinks else None
    folds = []
    fold_splits = paged_attention_module._fold_splits
    monkeypatch.setattr(paged_attention_module, "_fold_splits", lambda *a: folds.append(fold_splits(*a)))
    outs = []
    for sms in (1, 10_000):  # every launch folds in its programs; none does
        monkeypatch.setattr(paged_attention_module, "num_sms", lambda device, interpreted, sms=sms: sms)
        folds.clear()
        outs.append(paged_attention_triton(**case, invariant=True))
        assert bool(folds) == (sms > 1) and not arrivals, sms
    assert torch.equal(outs[0], outs[1])
    if sinks:
        check_sinks(outs[0], reference(case))
    else:
        check(outs[0], case)


@runs_kernel
@pytest.mark.parametrize("splits", [1, 2, 7])  # 2: combined by the last split to arrive, 7: by the combine kernel
@pytest.mark.parametrize("name", ["decode_g4_d128", "causal_window_g3_s5", "draft_block_window_g1"])
def test_sinks_match_reference(name: str, splits: int, poisoned_partials, arrivals) -> None:
    """Attention sinks (gpt-oss) against the reference: GQA groups of 4, 3 and 1, sliding windows
    (k_start > 0), the sink applied once to the whole row whether its keys were split or not."""
    case = make_case(*CASES[name], dtype=DTYPES[0])
    sinks = head_sinks(case["q"].shape[2])
    expected = reference(case | {"sinks": sinks})
    check_sinks(paged_attention_triton(**case, num_splits=splits, sinks=sinks), expected)
    assert_catches_wrong_sinks(expected, lambda s: reference(case | {"sinks": s}))


@runs_kernel
@pytest.mark.parametrize("splits", [1, 2, 7])
def test_sinks_with_a_row_that_sees_no_key(splits: int, poisoned_partials, arrivals) -> None:
    """A row with an empty key range gives its whole weight to the sink: zeros, as in the reference
    (no split holds any of its keys, so every partial is empty). bf16 sink logits (gpt-oss's)."""
    case = make_case(*CASES["causal_window_g3_s5"], dtype=DTYPES[0])
    case["k_start"][0, 2] = case["k_end"][0, 2]
    sinks = head_sinks(3, torch.bfloat16)
    expected = reference(case | {"sinks": sinks})
    out = paged_attention_triton(**case, num_splits=splits, sinks=sinks)
    assert torch.equal(out[0, 2], torch.zeros_like(out[0, 2]))
    check_sinks(out, expected)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_dispatch_uses_kernel_on_cuda() -> None:
    case = make_case(*CASES["verify_g4_s16_ragged"], dtype=torch.bfloat16)
    with torch.no_grad():  # grad mode takes the reference path
        torch.testing.assert_close(paged_attention(**case), paged_attention_triton(**case), atol=0, rtol=0)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("splits", [None, 1, 4])
def test_cuda_graph_replay_with_new_ranges(splits: int | None) -> None:
    """Captured once, replayed after the key ranges (and so the split boundaries) change."""
    case = make_case([200, 17], [16, 16], (32, 8), 128, 16, "block", dtype=torch.bfloat16)
    case["k_start"], case["k_end"] = case["k_start"].contiguous(), case["k_end"].contiguous()
    paged_attention_triton(**case, num_splits=splits)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention_triton(**case, num_splits=splits)
    graph.replay()
    check(out, case)
    case["k_start"].copy_(torch.tensor([[150], [0]], device=DEVICE).expand(2, 16))
    case["k_end"].copy_(torch.tensor([[216], [33]], device=DEVICE).expand(2, 16))
    graph.replay()
    check(out, case)


@runs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("weights", [True, False], ids=["qk_norm", "rope_only"])
@pytest.mark.parametrize("d", [64, 96])  # 96: half a head is not a power of two (masked lanes)
def test_qk_norm_rope_kernel_matches_reference(dtype: torch.dtype, weights: bool, d: int) -> None:
    """In place on a q|k|v row (Hq=4, Hkv=2, leading dims [2, 3]) against qk_norm_rope_ref:
    q and k heads normed (Qwen3) and rotated, v heads untouched."""
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(2, 3, 8, d, generator=gen).to(DEVICE, dtype)
    angles = torch.rand(2, 3, d // 2, generator=gen) * 6
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(DEVICE, dtype) for f in (torch.cos, torch.sin))
    w = [(torch.rand(d, generator=gen) + 0.5).to(DEVICE, dtype) for _ in range(2)] if weights else [None, None]
    expected = qk_norm_rope_ref(qkv, *w, 1e-6, cos, sin, 4, 2)
    v = qkv[:, :, 6:].clone()
    out = qk_norm_rope_triton(qkv, *w, 1e-6, cos, sin, 4, 2)
    assert out is qkv and torch.equal(qkv[:, :, 6:], v)
    with pytest.raises(AssertionError, match="heads"):  # the reference's split raises here too
        qk_norm_rope_triton(qkv, *w, 1e-6, cos, sin, 4, 3)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)


@runs_kernel
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("weights,d", [(True, 64), (False, 96)], ids=["qk_norm", "rope_only_d96"])
def test_qk_norm_rope_kernel_writes_the_cache(
    dtype: torch.dtype, cache_dtype: torch.dtype, weights: bool, d: int
) -> None:
    """With kv_write the same launch stores each token's rotated k heads and its v heads at its
    slot, bit for bit what `write_kv` stores from the kernel's own output; other slots keep
    their contents. As the model runs it: `rotary.qk_norm_rope` dispatches here on CUDA."""
    gen = torch.Generator().manual_seed(1)
    slots = 40
    qkv = torch.randn(2, 3, 8, d, generator=gen).to(DEVICE, dtype)  # Hq 4, Hkv 2
    angles = torch.rand(2, 3, d // 2, generator=gen) * 6
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(DEVICE, dtype) for f in (torch.cos, torch.sin))
    w = [(torch.rand(d, generator=gen) + 0.5).to(DEVICE, dtype) for _ in range(2)] if weights else [None, None]
    slot_mapping = torch.tensor([[7, 8, 9], [33, 1, 39]], device=DEVICE)
    caches = [torch.randn(slots, 2, d, generator=gen).to(DEVICE, cache_dtype) for _ in range(2)]
    initial, expected = [c.clone() for c in caches], [c.clone() for c in caches]
    original = qkv.clone()
    out = qk_norm_rope_triton(qkv.clone(), *w, 1e-6, cos, sin, 4, 2)
    write_kv(*expected, out[:, :, 4:6], out[:, :, 6:], slot_mapping)
    got = qk_norm_rope_triton(qkv, *w, 1e-6, cos, sin, 4, 2, (*caches, slot_mapping))
    assert torch.equal(got, out)
    assert all(map(torch.equal, caches, expected))
    with torch.no_grad():  # the dispatcher (the reference path on CPU, this kernel on CUDA) from scratch
        ref_caches = [c.clone() for c in initial]
        qk_norm_rope(original, *w, 1e-6, cos, sin, 4, 2, kv_write=(*ref_caches, slot_mapping))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for c, r in zip(caches, ref_caches, strict=True):
        torch.testing.assert_close(c.float(), r.float(), rtol=tol, atol=tol)


@runs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layers_kv_write_kernel_matches_reference(dtype: torch.dtype) -> None:
    """The drafter's context commit in one launch (`layers_kv_write_triton`): every layer's k heads,
    normed with its own weight row and rotated, and its v heads, read from one GEMM's output rows,
    into that layer's caches at its cache group's slots; against the reference (`layers_k`, then
    `write_kv` a layer). Padding rows go to the trash slot 0, which is not compared."""
    gen = torch.Generator().manual_seed(3)
    layers, hkv, d = 3, 2, 32
    rows = torch.randn(2, 4, layers * 2 * hkv * d, generator=gen).to(DEVICE, dtype)
    kv = rows.view(2, 4, layers, 2, hkv, d).movedim(-4, 0)
    weight = (torch.rand(layers, d, generator=gen) + 0.5).to(DEVICE, dtype)
    angles = torch.rand(2, 4, 1, generator=gen) * 9 / (1 + torch.arange(d // 2))
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(DEVICE, dtype) for f in (torch.cos, torch.sin))
    slot_mapping = torch.tensor([[[7, 8, 9, 0], [33, 1, 2, 0]], [[20, 21, 22, 0], [34, 5, 6, 0]]], device=DEVICE)
    groups = [0, 1, 0]
    caches = [tuple(torch.zeros(40, hkv, d, dtype=dtype, device=DEVICE) for _ in range(2)) for _ in range(layers)]
    expected = [tuple(c.clone() for c in pair) for pair in caches]
    with torch.no_grad(), reference_ops():
        layers_kv_write(expected, kv, weight, 1e-6, cos, sin, slot_mapping, groups)
    layers_kv_write_triton(caches, kv, weight, 1e-6, cos, sin, [slot_mapping[g] for g in groups])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for pair, want, g in zip(caches, expected, groups, strict=True):
        for c, e in zip(pair, want, strict=True):
            assert e[33 + g].abs().sum() > 0  # the reference wrote the rows compared, at its group's slots
            torch.testing.assert_close(c[1:].float(), e[1:].float(), rtol=tol, atol=tol)


def fused_step(name: str, weights: bool) -> dict:
    """A step of CASES[name] for the fused launch, as the engine runs it: a q|k|v projection whose
    rows sit at their positions (padding rows of a ragged batch at position 0, slot 0) and the new
    K/V's slots. "args": `qkv_attention_triton`'s (its caches, "caches", are written in place);
    "roped_q", "expected_caches": qk_norm_rope_ref's (with the K/V write), which paged_attention_ref
    over "ranges" turns into the expected output of the "real" rows."""
    starts, widths, (hq, hkv), d, page, *_ = CASES[name]
    case, dtype = make_case(*CASES[name], dtype=DTYPES[0]), DTYPES[0]
    gen = torch.Generator().manual_seed(5)
    B, S = len(starts), max(widths)
    qkv = torch.randn(B, S, hq + 2 * hkv, d, generator=gen).to(DEVICE, dtype)
    real = torch.arange(S) < torch.tensor(widths)[:, None]
    positions = torch.where(real, torch.tensor(starts)[:, None] + torch.arange(S), 0)
    tables = case["block_tables"].cpu()
    slots = torch.where(real, tables.gather(1, positions // page) * page + positions % page, 0).to(DEVICE)
    angles = positions[..., None] * 0.3 / (1 + torch.arange(d // 2))
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(DEVICE, dtype) for f in (torch.cos, torch.sin))
    norms = [(torch.rand(d, generator=gen) + 0.5).to(DEVICE, dtype) for _ in range(2)] if weights else [None, None]
    ranges = (case["block_tables"], case["k_start"], case["k_end"], page, case["scale"])
    expected_caches = [case["k_cache"].clone(), case["v_cache"].clone()]
    roped = qk_norm_rope_ref(qkv.clone(), *norms, 1e-6, cos, sin, hq, hkv, kv_write=(*expected_caches, slots))
    caches = [case["k_cache"].clone(), case["v_cache"].clone()]
    first = torch.tensor(starts, device=DEVICE)
    args = [qkv, *norms, 1e-6, cos, sin, first, slots, *caches, *ranges]
    return {"args": args, "caches": caches, "roped_q": roped[:, :, :hq], "expected_caches": expected_caches,
            "ranges": ranges, "real": real}  # fmt: skip


@runs_kernel
@pytest.mark.parametrize("block_m", [None, 64], ids=["step_grid", "one_tile"])
@pytest.mark.parametrize("splits", [1, 3, 7])
@pytest.mark.parametrize("weights", [True, False], ids=["qk_norm", "rope_only"])
@pytest.mark.parametrize(
    "name",
    ["decode_g4_d128", "verify_g4_s16_ragged", "verify_g4_s7_ragged", "draft_block_g3_d64", "draft_block_window_g1",
     "causal_window_g3_s5", "causal_window_3_s5", "tiny_model_d16_page_4"],
)  # fmt: skip
def test_qkv_attention_is_rope_and_write_then_attention(
    name: str, weights: bool, splits: int, block_m: int | None, poisoned_partials, arrivals
) -> None:
    """The fused launch against qk_norm_rope_ref (with the K/V write) then paged_attention_ref, as
    a step runs them (`fused_step`). Real rows' outputs and every real slot must agree.
    With 7 splits most hold none of the keys (their partials are zeros); 3 combine as they arrive. `step_grid` cuts these small
    batches' rows into tiles of 16 (each tile's last split makes the new keys, the first tile
    writes them); 64 keeps them in one tile."""
    step = fused_step(name, weights)
    qkv, caches, real = step["args"][0], step["caches"], step["real"]
    expected = paged_attention_ref(step["roped_q"], *step["expected_caches"], *step["ranges"])
    original = qkv.clone()
    assert fuses_qkv(qkv, caches[0])
    got = qkv_attention_triton(*step["args"], splits, block_m)
    assert torch.equal(qkv, original)  # q and k rotated in registers only
    tol = 1e-4 if qkv.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[real], expected[real], atol=tol, rtol=tol)
    for c, e in zip(caches, step["expected_caches"], strict=True):  # slot 0: the padding rows' trash slot
        torch.testing.assert_close(c[1:].float(), e[1:].float(), atol=tol, rtol=tol)


@runs_kernel
@pytest.mark.parametrize("splits", [1, 3, 7])
@pytest.mark.parametrize("name", ["decode_g4_d128", "verify_g4_s7_ragged", "causal_window_g3_s5"])
def test_qkv_attention_with_sinks(name: str, splits: int, poisoned_partials, arrivals) -> None:
    """The fused launch with attention sinks against the reference: splits combined as they arrive
    (3) and by the combine kernel (7), a verify cut into tiles of 16 rows, a sliding window."""
    step = fused_step(name, weights=True)
    sinks = head_sinks(step["roped_q"].shape[2])
    real = step["real"]

    def attend(s: torch.Tensor | None) -> torch.Tensor:  # the oracle in fp32, as `reference`
        q, caches = step["roped_q"].float(), [c.float() for c in step["expected_caches"]]
        return paged_attention_ref(q, *caches, *step["ranges"], sinks=s)[real]

    got = qkv_attention_triton(*step["args"], splits, sinks=sinks)
    expected = attend(sinks)
    check_sinks(got[real][:, None], expected[:, None])  # [rows, 1, Hq, D]: check_sinks's head dim
    assert_catches_wrong_sinks(expected[:, None], lambda s: attend(s)[:, None])


def test_qkv_attention_takes_one_query_tile_of_power_of_two_heads() -> None:
    cache = torch.empty(64, 8, 128)
    assert fuses_qkv(torch.empty(2, 16, 48, 128), cache)  # Qwen3-8B verify: 16 rows x 4 heads = 64
    assert not fuses_qkv(torch.empty(2, 17, 48, 128), cache)  # a short prefill: two query tiles
    assert not fuses_qkv(torch.empty(2, 0, 48, 128), cache)  # no rows
    assert not fuses_qkv(torch.empty(2, 16, 48, 128), cache.half())  # new keys would round on the way in
    assert not fuses_qkv(torch.empty(1, 2, 8, 80), torch.empty(64, 2, 80))  # rotary halves of 40 lanes


@pytest.mark.skipif(not INTERPRETED, reason="CPU: the interpreter stands in for the GPU (test_gpu covers CUDA)")
def test_engine_through_the_fused_attention_decodes_as_the_reference(tmp_path, monkeypatch) -> None:
    """The attention kernels (the fused one where a step fits one query tile) forced on for CPU
    tensors in the interpreter: greedy decoding, plain and speculative (target verify, drafter
    propose over its context and block, ragged widths), equals the reference path's, fp32."""
    t = make_target(tmp_path / "t", "qwen3", vocab=128, layers=2)
    d = make_drafter(tmp_path / "d", t, layers=1, block_size=4)
    prompts, params = [[5, 9, 2, 11, 7], [3] * 9], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    spec = {"model": str(d), "adaptive_width": False}
    expected = [o.outputs[0].token_ids for o in LLM(str(t), spec, device="cpu").generate(prompts, params)]
    fused = []  # the rows of each step the fused kernel took: full blocks (4) and one-row steps among them
    monkeypatch.setattr(attention_module, "fast_kernels", lambda x, name: kernel_module(name))
    monkeypatch.setattr(
        kernel_module("paged_attention"),
        "qkv_attention_triton",
        lambda *a, **kw: fused.append(a[0].shape[1]) or qkv_attention_triton(*a, **kw),
    )
    got = [o.outputs[0].token_ids for o in LLM(str(t), spec, device="cpu").generate(prompts, params)]
    assert got == expected and {1, 4} <= set(fused)
