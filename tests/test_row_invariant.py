"""Row-invariant numerics (`blockspec.layers.row_invariant`): a row's result is the same bits
whatever rows share the call, so a greedy request gives the same tokens alone, in a batch of
others, at any draft width, and equal to plain decoding, in fp32 and in bf16; seeded sampling
reproduces across batches."""

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    INVARIANCE_PROMPTS,
    alone_and_in_batch,
    assert_row_invariant_pair,
    assert_shipped_pair_row_invariant,
    make_target,
    random_prompts,
    twin_head_pair,
)

from blockspec import LLM, SamplingParams
from blockspec.config import KernelConfig
from blockspec.layers import row_invariant
from blockspec.layers.attention import AttentionMetadata, paged_attention_ref
from blockspec.layers.cpu_gemm import pack
from blockspec.layers.fast_path import use_kernels
from blockspec.layers.row_invariant import (
    EXP_FORMS,
    ROW_TILE,
    elementwise,
    keeps_bits,
    key_plan,
    tiled_attention,
    tiled_linear,
)

DTYPES = [torch.float32, torch.bfloat16]
# The target's LM head rows come in twins this far apart (relative): whichever token leads, its twin's
# logit is a near-tie that fp32 rounding flips as soon as the row's numbers move (without row
# invariance the fp32 greedy test fails; in bf16 the twins round to ties or far apart, and the
# shipped pair's test is the bf16 one that fails without it).
TWIN_GAP = 1e-5


@pytest.mark.parametrize("packed", [False, True], ids=["mm", "packed"])
@pytest.mark.parametrize("dtype", DTYPES)
@torch.inference_mode()
def test_tiled_linear_gives_a_row_the_same_bits_at_any_row_count(dtype, packed):
    """Also on the CPU's packed copy (oneDNN's bf16 GEMM picks its kernel by the row count: the
    fixed tile keeps it)."""
    torch.manual_seed(0)
    w, b = torch.randn(1536, 576, dtype=dtype), torch.randn(1536, dtype=dtype)
    copy = pack(w) if packed and torch.backends.mkldnn.is_available() else None
    if packed and copy is None:
        pytest.skip("no packed copy of this dtype on this CPU")
    x = torch.randn(300, 576, dtype=dtype)
    alone = torch.cat([tiled_linear(x[i : i + 1], w, b, copy) for i in range(300)])
    for start, rows in [(0, 2), (0, ROW_TILE), (3, ROW_TILE + 1), (5, 33), (0, 300)]:
        together = tiled_linear(x[start : start + rows], w, b, copy)
        assert torch.equal(together, alone[start : start + rows]), (start, rows)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(alone, F.linear(x, w, b), rtol=tol, atol=tol)


def paged_case(lengths: list[int], dtype: torch.dtype, page_size: int = 4, heads: tuple[int, int] = (6, 2)):
    """Random K/V pools with each sequence's pages scattered over them (page 0 left as the trash
    page), and the block tables: (k_cache, v_cache, block_tables)."""
    g = torch.Generator().manual_seed(1)
    pages = [-(-n // page_size) for n in lengths]
    order = (torch.randperm(sum(pages), generator=g) + 1).tolist()
    tables = torch.zeros(len(lengths), max(pages), dtype=torch.long)
    for b, n in enumerate(pages):
        tables[b, :n] = torch.tensor(order[:n])
        del order[:n]
    shape = ((sum(pages) + 1) * page_size, heads[1], 16)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype), tables


def float64_scores(q, k, out=None):
    """`row_invariant.attention_scores` in float64, rounded once: a row's bits do not follow the call."""
    result = torch.bmm(q.double(), k.double().transpose(1, 2)).float()
    return result if out is None else out.copy_(result)


def float64_values(p, v, out=None):
    """`row_invariant.weighted_values` in float64, rounded once."""
    result = torch.bmm(p.double(), v.double()).float()
    return result if out is None else out.copy_(result)


def use_float64_attention_gemms(monkeypatch) -> None:
    """Attention GEMMs that keep a row's bits in calls of any rows, on any CPU: the check passes
    them, and calls take the rows padded to a multiple of four."""
    monkeypatch.setattr(row_invariant, "_attention_kept", {})
    monkeypatch.setattr(row_invariant, "attention_scores", float64_scores)
    monkeypatch.setattr(row_invariant, "weighted_values", float64_values)


@pytest.mark.parametrize("calls", ["as checked", "multiples of four", "fixed tiles"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["causal", "window", "late window", "sinks"])
def test_tiled_attention_gives_a_row_the_same_bits_alone_in_a_block_and_in_a_batch(dtype, kind, calls, monkeypatch):
    """Each row of a batch of blocks (a verify step: causal rows; a windowed drafter block, whose
    keys in a late window start past every sequence's first chunk; with gpt-oss's sinks) equals that
    row attending alone (a decode step) and in a block of two (a width-2 verify), bit for bit, and
    the reference; with the GEMMs' rows as this machine's check allows; with GEMMs that pass the
    check on any CPU, so that its rows padded to a multiple of four are tested wherever the
    machine's own GEMMs fail it; and in the fixed tiles that serve then."""
    if calls == "multiples of four":
        use_float64_attention_gemms(monkeypatch)
        assert row_invariant.attention_gemm_keeps_rows(16, 128)
    if calls == "fixed tiles":
        monkeypatch.setattr(row_invariant, "attention_gemm_keeps_rows", lambda *_: False)
    lengths, block, page_size = [300, 370, 250] if kind == "late window" else [37, 300, 150], 20, 4
    k_cache, v_cache, tables = paged_case(lengths, dtype, page_size)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(len(lengths), block, 6, 16, generator=g).to(dtype)
    positions = torch.tensor([[n - block + i for i in range(block)] for n in lengths])
    k_end = positions + 1
    k_start = (k_end - 50).clamp_min(0) if "window" in kind else torch.zeros_like(k_end)
    sinks = torch.randn(6, generator=g) if kind == "sinks" else None
    together = tiled_attention(q, k_cache, v_cache, tables, k_start, k_end, page_size, 0.25, sinks)
    for b in range(len(lengths)):
        for i in range(block):
            rows = slice(i, i + 1) if i % 2 == 0 else slice(i - 1, i + 1)
            ends = (k_start[b : b + 1, rows], k_end[b : b + 1, rows])
            alone = tiled_attention(
                q[b : b + 1, rows], k_cache, v_cache, tables[b : b + 1], *ends, page_size, 0.25, sinks
            )
            assert torch.equal(alone[0, -1], together[b, i]), (b, i)
    reference = paged_attention_ref(q, k_cache, v_cache, tables, k_start, k_end, page_size, 0.25, sinks)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(together, reference, rtol=tol, atol=tol)


def test_a_steps_layers_of_one_type_share_one_key_plan(monkeypatch):
    """Under row invariance on the CPU, a step's first layer of a type makes the key plan and the
    next layer of that type reuses it (the plan is made once); each layer's result equals its
    attention with a plan of its own."""
    use_kernels(KernelConfig(row_invariant=True))
    lengths, block, page_size = [37, 300, 150], 4, 4
    k_cache, v_cache, tables = paged_case(lengths, torch.float32, page_size)
    q = torch.randn(len(lengths), block, 6, 16, generator=torch.Generator().manual_seed(3))
    k_end = torch.tensor([[n - block + i + 1 for i in range(block)] for n in lengths])
    ranges = {"full_attention": (torch.zeros_like(k_end), k_end)}
    slots = torch.zeros(1, *k_end.shape, dtype=torch.long)  # unused: the new K/V are in the caches already
    attn = AttentionMetadata(tables[:, None], slots, {"full_attention": 0}, ranges, page_size, k_end[:, 0] - 1)
    made = []
    monkeypatch.setattr(row_invariant, "key_plan", lambda *a: made.append(a) or key_plan(*a))
    layers = [(k_cache, v_cache), (v_cache, k_cache)]  # two layers' caches
    got = [attn.attend(q, None, None, cache, "full_attention", 0.25) for cache in layers]
    assert len(made) == 1 and list(attn.key_plans["full_attention"]) == [(3, 16)]
    for out, cache in zip(got, layers):
        assert torch.equal(out, tiled_attention(q, *cache, tables, *ranges["full_attention"], page_size, 0.25))


def test_attention_gemm_check_refuses_a_gemm_whose_rows_round_by_the_row_count(monkeypatch):
    """GEMMs whose rows keep their bits pass the check; one whose rows round apart in calls of other
    row counts (as MKL's do at 5-7 rows) fails it, and every call then runs in fixed tiles."""

    def by_row_count(q, k, out=None):
        if q.shape[1] % 8:
            return float64_scores(q, k, out)
        return torch.bmm(q, k.transpose(1, 2), out=out)

    use_float64_attention_gemms(monkeypatch)
    assert row_invariant.attention_gemm_keeps_rows(16, 128)
    monkeypatch.setattr(row_invariant, "_attention_kept", {})
    monkeypatch.setattr(row_invariant, "attention_scores", by_row_count)
    assert not row_invariant.attention_gemm_keeps_rows(16, 128)


@pytest.mark.parametrize("way", ["kernel", "exp form", "float64"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fn", [F.silu, torch.sigmoid, torch.exp, torch.tanh])
def test_elementwise_under_row_invariance_keeps_an_elements_bits_wherever_it_sits(fn, dtype, way, monkeypatch):
    """Under row invariance an element's result is the same bits in a call of any size and at any
    place in it, and close to the exact value, whichever way `elementwise` takes (forced here by
    `keeps_bits`' findings; each is taken only where it holds on this CPU): torch's kernel, the
    function's float32 exp form (SiLU, sigmoid), float64. Off, torch's kernel."""
    form = EXP_FORMS.get(fn)
    if way == "exp form" and (form is None or not keeps_bits(form, torch.float32)):
        pytest.skip("no exp form, or one that moves an element's bits on this CPU")
    if way == "kernel" and not keeps_bits(fn, dtype):
        pytest.skip("torch's kernel moves an element's bits on this CPU")
    threads = torch.get_num_threads()
    monkeypatch.setitem(row_invariant._kept, (fn, dtype, threads), way == "kernel")
    if form is not None:
        monkeypatch.setitem(row_invariant._kept, (form, torch.float32, threads), way == "exp form")
    x = (torch.randn(70_001, generator=torch.Generator().manual_seed(0)) * 8).to(dtype)
    expected = {"kernel": fn(x), "float64": fn(x.double()).to(dtype)}
    expected["exp form"] = form(x.float()).to(dtype) if form is not None else None
    use_kernels(KernelConfig(row_invariant=True))
    whole = elementwise(fn, x)
    assert torch.equal(whole, expected[way])
    for start, n in [(0, 7), (9, 7), (3, 40_000), (100, 33), (17, 70_000)]:
        assert torch.equal(elementwise(fn, x[start : start + n].clone()), whole[start : start + n]), (start, n)
    tolerance = {"rtol": 1e-6, "atol": 1e-7} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 1e-5}
    torch.testing.assert_close(whole.double(), fn(x.double()), **tolerance)
    use_kernels(KernelConfig(row_invariant=False))
    assert torch.equal(elementwise(fn, x), fn(x))


def test_keeps_bits_tells_a_kernel_whose_tail_rounds_apart():
    """The check passes an exact elementwise op and fails one whose last elements of a call take
    other math (as a scalar tail loop would); a kernel it passes keeps an element's bits on other
    values and slices too."""

    def scalar_tail(x: torch.Tensor) -> torch.Tensor:
        out = torch.exp(x)
        out[-3:] = torch.exp(x[-3:].double()).float() * (1 + 2**-20)
        return out

    assert keeps_bits(torch.neg, torch.float32)
    assert not keeps_bits(scalar_tail, torch.float32)
    x = torch.randn(70_001, generator=torch.Generator().manual_seed(1)) * 8
    for fn in (torch.exp, F.silu, torch.sigmoid, torch.tanh):
        if keeps_bits(fn, torch.float32):
            whole = fn(x)
            assert all(torch.equal(fn(x[i : i + n].clone()), whole[i : i + n]) for i, n in [(3, 40_000), (9, 7)]), fn


@pytest.fixture(scope="module")
def qwen3_pair(tmp_path_factory):
    return twin_head_pair(tmp_path_factory.mktemp("row_invariant"), "qwen3", TWIN_GAP)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_output_is_the_same_alone_in_a_batch_at_any_width_and_plain(tmp_path, family, dtype):
    """Dense, MoE (experts' rows grouped per expert) and sliding-window + sinks attention."""
    t, d = twin_head_pair(tmp_path, family, TWIN_GAP)
    assert_row_invariant_pair(t, d, "cpu", dtype, [{"adaptive_width": False}, {}, {"num_speculative_tokens": 3}])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_seeded_sampling_is_the_same_alone_and_in_a_batch(qwen3_pair, dtype):
    t, d = qwen3_pair
    params = SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True, seed=11)
    for spec in (None, {"model": d, "adaptive_width": False}):
        llm = LLM(t, spec, device="cpu", dtype=dtype, row_invariant=True)
        alone, together = alone_and_in_batch(llm, params, INVARIANCE_PROMPTS, random_prompts(13))
        assert alone == together, spec


def test_row_invariance_is_asked_for_and_refused_where_unsupported(qwen3_pair, tmp_path):
    t, _ = qwen3_pair
    assert not LLM(t, None, device="cpu", dtype="bfloat16").engine.kernels.row_invariant
    assert LLM(t, None, device="cpu", dtype="bfloat16", row_invariant=True).engine.kernels.row_invariant
    hybrid = make_target(tmp_path / "hybrid", "qwen3_5", layers=4)
    assert not LLM(str(hybrid), None, device="cpu", dtype="bfloat16").engine.kernels.row_invariant
    with pytest.raises(ValueError, match="row_invariant: not supported for targets with linear-attention layers"):
        LLM(str(hybrid), None, device="cpu", row_invariant=True)
    with pytest.raises(ValueError, match="set EngineConfig.row_invariant, not kernels.row_invariant"):
        LLM(t, None, device="cpu", kernels=KernelConfig(row_invariant=True))


def test_shipped_pair_in_bf16_is_the_same_alone_in_a_batch_and_plain():
    """bf16, the CLI's default dtype on this CPU, with row invariance."""
    assert_shipped_pair_row_invariant("cpu", max_tokens=48)
