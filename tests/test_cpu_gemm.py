"""CPU linears on packed weights (`blockspec.layers.cpu_gemm`): the same results as F.linear, taken
where they pay, made at load for every linear of a target and its drafter, none with the switch
off; under row invariance float32 copies that give a row the same bits at any row count."""

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from blockspec import LLM, SamplingParams
from blockspec.config import KernelConfig, SpeculativeConfig
from blockspec.layers import cpu_gemm, linear, row_invariant
from blockspec.layers.cpu_gemm import MIN_ROWS, invariant_rows, onednn_gemm, pack, packed_linear, takes_packed
from blockspec.layers.fast_path import use_kernels
from blockspec.layers.linear import Linear
from blockspec.layers.norm import RMSNorm
from blockspec.loading import finish
from blockspec.loading.finish import cpu_packed_dtype

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs torch's oneDNN")

TOLERANCE = {torch.float32: {"atol": 1e-4, "rtol": 1e-4}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}
BF16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
needs_bf16 = pytest.mark.skipif(not BF16, reason="a CPU with bf16 instructions")
DTYPES = [torch.float32] + [torch.bfloat16] * BF16


@pytest.mark.parametrize("dtype", DTYPES)
@torch.inference_mode()
def test_packed_linear_equals_f_linear(dtype):
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 64, generator=gen).to(dtype), torch.randn(96, generator=gen).to(dtype)
    packed = pack(weight)
    for rows in (1, 3, 16, 100):
        x = torch.randn(2, rows, 64, generator=gen).to(dtype)
        for b in (None, bias):
            torch.testing.assert_close(packed_linear(x, packed, b), F.linear(x, weight, b), **TOLERANCE[dtype])


@torch.inference_mode()
def test_linear_with_a_packed_weight_keeps_its_norm_swiglu_and_residual():
    """The packed copy serves the GEMM (a copy of 2 x the weight doubles it), the norm before it and
    the SwiGLU or residual after it as without one."""
    gen = torch.Generator().manual_seed(1)
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.rand(64, generator=gen) + 0.5
    x, residual = torch.randn(5, 64, generator=gen), torch.randn(5, 48, generator=gen)
    up, down = torch.randn(96, 64, generator=gen), torch.randn(48, 64, generator=gen)
    for weight, options in ((up, {"swiglu": True}), (down, {"residual": residual})):
        expected = linear.linear(x, 2 * weight, None, norm, **options)
        got = linear.linear(x, weight, None, norm, **options, packed=pack(2 * weight))
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_the_packed_copy_serves_where_it_pays(monkeypatch):
    """fp32 from 3 rows where not measured (MKL's own path is faster below on Intel's CPUs), bf16
    from one; never with grad, in another dtype than the copy's (float32 rows on a bf16 copy aside),
    without a copy, or with the switch off; under row invariance a copy whose rows oneDNN keeps
    (`invariant_rows`, float32 or bf16) at any rows, and no other."""
    monkeypatch.setattr(cpu_gemm, "_min_rows", {})
    weight = torch.randn(8, 4)
    packed = pack(weight)
    assert MIN_ROWS[torch.float32] == 3
    with torch.inference_mode():
        assert not takes_packed(torch.randn(2, 4), packed)
        assert takes_packed(torch.randn(3, 4), packed) and takes_packed(torch.randn(1, 3, 4), packed)
        assert not takes_packed(torch.randn(3, 4), None)
        assert not takes_packed(torch.randn(3, 4).double(), packed)
        assert not takes_packed(torch.randn(3, 4).bfloat16(), packed)
        if BF16:
            assert takes_packed(torch.randn(1, 4).bfloat16(), pack(weight.bfloat16()))
    assert not takes_packed(torch.randn(3, 4), packed)  # grad on: training's GEMMs
    assert pack(weight.double()) is None
    use_kernels(KernelConfig(row_invariant=True))
    with torch.inference_mode():
        chosen = {takes_packed(torch.randn(rows, 4), packed) for rows in (1, 2, 3, 300)}
        assert chosen == {invariant_rows(packed)}  # whatever the rows: a row's GEMM must not change
        if BF16:
            bf16 = pack(weight.bfloat16())
            chosen = {takes_packed(torch.randn(rows, 4).bfloat16(), bf16) for rows in (1, 2, 3, 300)}
            assert chosen == {invariant_rows(bf16)}
    use_kernels(KernelConfig(cpu_packed=False))
    with torch.inference_mode():
        assert not takes_packed(torch.randn(3, 4), packed)


@pytest.mark.parametrize(
    "seconds,rows",
    [
        ({(2, True): 1.0, (2, False): 2.0, (1, True): 1.0, (1, False): 2.0}, 1),  # AMD's CPUs: MKL far slower
        ({(2, True): 1.0, (2, False): 2.0, (1, True): 1.0, (1, False): 1.05}, 2),
        ({(2, True): 1.0, (2, False): 1.1, (1, True): 1.0, (1, False): 2.0}, 3),  # within the margin at 2
        ({(2, True): 1.2, (2, False): 1.0, (1, True): 1.2, (1, False): 1.0}, 3),  # Intel's: MKL faster
    ],
)
def test_fp32_copies_serve_from_the_measured_rows(monkeypatch, seconds, rows):
    """`measure_min_rows` keeps the fewest rows at which, and above which, the packed GEMM is
    MEASURE_MARGIN faster, once a thread count, never from a model too small to time; `takes_packed`
    follows it."""
    monkeypatch.setattr(cpu_gemm, "_min_rows", {})
    monkeypatch.setattr(cpu_gemm, "pass_seconds", lambda pairs, m, packed: seconds[m, packed])
    small = [(torch.empty(1024, 1024), None)]  # 4 MB
    cpu_gemm.measure_min_rows(small)
    assert cpu_gemm._min_rows == {} and cpu_gemm.min_rows(torch.float32) == MIN_ROWS[torch.float32]
    large = small * 8  # 32 MB
    cpu_gemm.measure_min_rows(large)
    assert cpu_gemm.min_rows(torch.float32) == rows and cpu_gemm.min_rows(torch.bfloat16) == MIN_ROWS[torch.bfloat16]
    monkeypatch.setattr(cpu_gemm, "pass_seconds", lambda pairs, m, packed: 1.0 if packed else 3.0)
    cpu_gemm.measure_min_rows(large)  # measured once for these threads
    assert cpu_gemm.min_rows(torch.float32) == rows
    packed = pack(torch.randn(8, 4))
    with torch.inference_mode():
        assert [takes_packed(torch.randn(m, 4), packed) for m in (1, 2, 3)] == [m >= rows for m in (1, 2, 3)]


def test_packing_a_large_enough_model_measures_its_float32_copies(monkeypatch):
    """`pack_linears` hands `measure_min_rows` the float32 weights with float32 copies, and only
    those: a bf16-packed model is not measured, a float32 one of 16 MB is."""
    monkeypatch.setattr(cpu_gemm, "_min_rows", {})
    measured = []
    monkeypatch.setattr(
        cpu_gemm, "pass_seconds", lambda pairs, m, packed: measured.append(pairs) or (1.0 if packed else 2.0)
    )
    model = torch.nn.Sequential(*[Linear(1024, 1024, bias=False) for _ in range(4)])  # 16 MB of fp32
    if BF16:
        linear.pack_linears(model, torch.bfloat16)
        assert measured == [] and cpu_gemm._min_rows == {}
    linear.pack_linears(model)
    assert cpu_gemm._min_rows == {torch.get_num_threads(): 1}
    assert all(w.dtype == p.dtype == torch.float32 and len(pairs) == 4 for pairs in measured for w, p in pairs)


def same_bits_at_any_row_count(weight: torch.Tensor, packed: torch.Tensor) -> None:
    """`linear.gemm` on the copy gives each row of 300 (bias and residual added) the same bits alone,
    at counts around the tile and call sizes, and at offsets, as in one call of them all."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(300, weight.shape[1], generator=gen).to(weight.dtype)
    bias = torch.randn(weight.shape[0], generator=gen).to(weight.dtype)
    residual = torch.randn(300, weight.shape[0], generator=gen).to(weight.dtype)
    whole = linear.gemm(x, weight, bias, residual, packed)
    expected = residual.float() + F.linear(x.float(), weight.float(), bias.float())
    # bf16: the GEMM's output and the residual add each round to bf16 (a unit in the last place of
    # values near 4 is 0.03)
    tolerance = TOLERANCE[torch.float32] if weight.dtype == torch.float32 else {"atol": 6e-2, "rtol": 2e-2}
    torch.testing.assert_close(whole.float(), expected, **tolerance)
    for start, rows in [(0, 1), (299, 1), (0, 6), (3, 17), (0, 47), (5, 128), (0, 129), (40, 200)]:
        part = slice(start, start + rows)
        assert torch.equal(linear.gemm(x[part], weight, bias, residual[part], packed), whole[part]), (start, rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(96, 64), (576, 1536), (49152, 576)])
@torch.inference_mode()
def test_under_row_invariance_a_copy_keeps_a_rows_bits_in_one_call(shape, dtype):
    """Where the check finds oneDNN keeping a row's bits at the shape and dtype on this CPU (it tries
    counts up to INVARIANT_CALL_ROWS), whole calls keep them at other counts and offsets too, past a
    call's rows (split) as well."""
    if dtype == torch.bfloat16 and not BF16:
        pytest.skip("no bf16 GEMM on this CPU")
    use_kernels(KernelConfig(row_invariant=True))
    weight = (torch.randn(*shape, generator=torch.Generator().manual_seed(3)) / 8).to(dtype)
    packed = pack(weight)
    if not invariant_rows(packed):
        pytest.skip(f"oneDNN's {dtype} GEMM does not keep a row's bits at this shape here: tiles serve it")
    assert takes_packed(torch.randn(1, shape[1], dtype=dtype), packed)
    same_bits_at_any_row_count(weight, packed)


@torch.inference_mode()
def test_a_lone_row_is_padded_where_onednn_rounds_it_apart(monkeypatch):
    """A GEMM whose lone rows take other math (a last-bit nudge here, as oneDNN's other path at some
    shapes): the check finds rows from two kept and a lone row not, and a lone row then runs padded,
    with the bits it has among others. Where a lone row keeps its bits, it runs alone."""
    honest = cpu_gemm.onednn_gemm
    nudge, calls = [True], []

    def gemm(rows, packed, bias=None):
        calls.append(rows.shape[0])
        y = honest(rows, packed, bias)
        return y * (1 + 2**-20) if nudge[0] and rows.shape[0] == 1 else y

    monkeypatch.setattr(cpu_gemm, "onednn_gemm", gemm)
    weight = torch.randn(96, 64, generator=torch.Generator().manual_seed(4)) / 8
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(5))
    packed = pack(weight)
    for lone_apart in (True, False):
        nudge[0] = lone_apart
        monkeypatch.setattr(cpu_gemm, "_checked", {})
        kept = cpu_gemm.kept_rows(packed)
        assert kept.from_two and not (lone_apart and kept.lone)
        calls.clear()
        assert torch.equal(cpu_gemm.invariant_gemm(x[2:3], packed), honest(x, packed)[2:3])
        assert calls == [1 if kept.lone else 2]


@torch.inference_mode()
def test_the_check_tries_every_batch_of_its_dtype(monkeypatch):
    """A GEMM that rounds a row apart at fewer rows only for some inputs (as oneDNN's bf16 GEMM on an
    AMX Xeon does, a few outputs in 10^5, hidden in most batches by the rounding): the first batch
    shows nothing, a later one does, and the copy is not taken to keep a row's bits."""
    honest = cpu_gemm.onednn_gemm
    wholes = [0]

    def gemm(rows, packed, bias=None):
        y = honest(rows, packed, bias)
        if rows.shape[0] == cpu_gemm.INVARIANT_CALL_ROWS:
            wholes[0] += 1
        elif wholes[0] >= 2 and rows.shape[0] > 1:
            y[0, 0] = y[0, 0] * (1 + 2**-20)
        return y

    monkeypatch.setattr(cpu_gemm, "onednn_gemm", gemm)
    packed = pack(torch.randn(96, 64, generator=torch.Generator().manual_seed(6)) / 8)
    for batches, kept in ((1, True), (3, False)):
        monkeypatch.setitem(cpu_gemm.CHECK_BATCHES, torch.float32, batches)
        monkeypatch.setattr(cpu_gemm, "_checked", {})
        wholes[0] = 0
        assert cpu_gemm.kept_rows(packed).from_two is kept


@torch.inference_mode()
def test_under_row_invariance_a_copy_that_fails_the_check_serves_fixed_tiles(monkeypatch):
    use_kernels(KernelConfig(row_invariant=True))
    monkeypatch.setattr(cpu_gemm, "invariant_rows", lambda packed: False)
    tiles = []

    monkeypatch.setattr(row_invariant, "onednn_gemm", spying(lambda x, packed: tiles.append(x.shape[0]), onednn_gemm))
    weight = torch.randn(576, 1536, generator=torch.Generator().manual_seed(5)) / 8
    packed = pack(weight)
    assert not takes_packed(torch.randn(3, 1536), packed)
    same_bits_at_any_row_count(weight, packed)
    assert tiles and set(tiles) == {16}  # every GEMM a 16-row tile on the copy


def spying(record: Callable, gemm: Callable) -> Callable:
    """`gemm` (rows, packed copy[, bias]) with `record(rows, packed)` called first: a linear's copies
    and rows seen where they are served."""

    def spy(x, packed, bias=None):
        record(x, packed)
        return gemm(x, packed, bias)

    return spy


def linears(llm: LLM) -> list[Linear]:
    models = [llm.engine.target.model, llm.engine.drafter]
    return [m for model in models for m in model.modules() if isinstance(m, Linear)]


def test_loading_packs_every_linear_on_the_cpu_unless_switched_off(llama_pair, monkeypatch):
    """Every linear, and the drafter's context K/V GEMM, runs on its packed copy in a speculative
    step, with row invariance too; with the switch off none is made."""
    target, drafter = llama_pair
    # every step at the full block: a narrow one (adaptive width's choice, by timing) drafts 1-2 rows,
    # which a float32 copy does not serve where the rows it serves from are not measured
    spec = {"model": str(drafter), "adaptive_width": False}
    llm = LLM(str(target), spec, device="cpu")
    assert linears(llm) and all(m.packed is not None for m in linears(llm))
    copies = {id(m.packed) for m in linears(llm)} | {id(llm.engine.drafter.fused_kv_packed)}
    served = set()

    def record(x, packed):
        served.add(id(packed))

    monkeypatch.setattr(linear, "packed_linear", spying(record, packed_linear))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = llm.generate([[1, 5, 9, 2]], params)[0].outputs[0].token_ids
    assert served == copies  # the prompt's prefill, the verify's and the drafter's rows
    off = LLM(str(target), spec, device="cpu", kernels=KernelConfig(cpu_packed=False))
    assert all(m.packed is None for m in linears(off)) and off.engine.drafter.fused_kv_packed is None
    # the same greedy tokens (fp32: the GEMMs round differently, and this tiny model has no near ties)
    assert off.generate([[1, 5, 9, 2]], params)[0].outputs[0].token_ids == tokens
    for dtype in DTYPES:  # under row invariance the copies serve too: in one call or in fixed tiles
        invariant = LLM(str(target), spec, device="cpu", dtype=dtype, row_invariant=True)
        copies = {id(m.packed) for m in linears(invariant)} | {id(invariant.engine.drafter.fused_kv_packed)}
        monkeypatch.setattr(row_invariant, "onednn_gemm", spying(record, onednn_gemm))
        served.clear()
        out = invariant.generate([[1, 5, 9, 2]], params)[0].outputs[0].token_ids
        assert served == copies
        if dtype == torch.float32:
            assert out == tokens


@needs_bf16
@torch.inference_mode()
def test_a_bf16_copy_serves_float32_rows_in_bf16():
    """A float32 engine's drafter on bf16 copies: its rows rounded to bf16, the GEMM in bf16, the
    result back in float32, from one row."""
    gen = torch.Generator().manual_seed(2)
    weight, bias = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    packed = pack(weight, torch.bfloat16)
    assert packed.dtype == torch.bfloat16
    for rows in (1, 5):
        x = torch.randn(rows, 64, generator=gen)
        assert takes_packed(x, packed)
        got = packed_linear(x, packed, bias)
        assert got.dtype == torch.float32
        expected = F.linear(x.bfloat16(), weight.bfloat16(), bias.bfloat16()).float()
        torch.testing.assert_close(got, expected, **TOLERANCE[torch.bfloat16])


def test_a_float32_drafters_copies_are_bf16_where_asked_and_supported(monkeypatch):
    """`SpeculativeConfig.cpu_bf16`: auto means bf16 where the CPU multiplies bf16 natively, for a
    float32 engine only; on where oneDNN has no bf16 GEMM is refused, and a bad value with the
    config, each naming the setting."""
    monkeypatch.setattr(finish, "native_cpu_bf16", lambda: True)
    assert cpu_packed_dtype("auto", torch.float32) == (torch.bfloat16 if BF16 else None)
    assert cpu_packed_dtype("auto", torch.bfloat16) is None  # a bf16 engine's copies are bf16 already
    assert cpu_packed_dtype(False, torch.float32) is None and cpu_packed_dtype("off", torch.float32) is None
    monkeypatch.setattr(finish, "native_cpu_bf16", lambda: False)  # AVX-512 without bf16: oneDNN emulates it
    assert cpu_packed_dtype("auto", torch.float32) is None
    monkeypatch.setattr(finish, "bf16_supported", lambda: False)
    with pytest.raises(ValueError, match="cpu_bf16 is on, but oneDNN has no bf16 GEMM on this CPU"):
        cpu_packed_dtype(True, torch.float32)
    with pytest.raises(ValueError, match="cpu_bf16"):
        SpeculativeConfig(cpu_bf16="sometimes")  # refused with the config, before anything loads
    with pytest.raises(TypeError, match="cpu_bf16"):
        SpeculativeConfig(cpu_bf16=3)


@needs_bf16
def test_a_float32_engines_drafter_reads_bf16_copies_and_stays_lossless(llama_pair, monkeypatch):
    """The drafter's linears, context K/V GEMM and its copy of the target's LM head in bf16 (that
    copy serving its logits, under row invariance too), the target's in float32; greedy output
    as plain decoding's, and as with float32 copies."""
    target, drafter = llama_pair
    head_rows, head = [], {}

    def record(x, packed):
        if packed is head.get("copy"):
            head_rows.append(x.shape[:-1].numel())

    monkeypatch.setattr(linear, "packed_linear", spying(record, packed_linear))
    monkeypatch.setattr(row_invariant, "onednn_gemm", spying(record, onednn_gemm))
    monkeypatch.setattr(finish, "native_cpu_bf16", lambda: True)  # auto: as on a CPU with AVX512-BF16
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[1, 5, 9, 2], [7, 3, 3, 8, 1]]
    plain = [o.outputs[0].token_ids for o in LLM(str(target), device="cpu").generate(prompts, params)]
    for setting, dtype in (("auto", torch.bfloat16), ("off", torch.float32)):
        llm = LLM(str(target), {"model": str(drafter), "cpu_bf16": setting}, device="cpu")
        d = llm.engine.drafter
        assert {m.packed.dtype for m in d.modules() if isinstance(m, Linear)} == {dtype}
        assert d.fused_kv_packed.dtype == dtype
        assert (d.lm_head_packed is not None) == (dtype == torch.bfloat16) and d.lm_head is None
        assert {m.packed.dtype for m in llm.engine.target.model.modules() if isinstance(m, Linear)} == {torch.float32}
        head_rows.clear()
        head["copy"] = d.lm_head_packed
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain
        assert bool(head_rows) == (dtype == torch.bfloat16)  # the drafter's logits on the bf16 copy
    invariant = LLM(str(target), {"model": str(drafter), "cpu_bf16": "auto"}, device="cpu", row_invariant=True)
    head_rows.clear()
    head["copy"] = invariant.engine.drafter.lm_head_packed
    assert [o.outputs[0].token_ids for o in invariant.generate(prompts, params)] == plain
    # one call of a step's rows where oneDNN keeps a row's bits in bf16 here, else fixed tiles
    assert head_rows and (set(head_rows) != {16} if invariant_rows(head["copy"]) else set(head_rows) == {16})
