"""The Triton draw of a plain step's sampled token (`blockspec.sampling.sample_rows` on CUDA) against
its reference, `draw` of `probs` without filters: the same token for every row, over chunk
boundaries, temperatures (0 taking 1), masked tokens and uniforms at the ends of [0, 1). On the CPU
it runs in Triton's interpreter (test_kernels_in_interpreter, as in test_kernels_attention)."""

import pytest
import torch

pytest.importorskip("triton")

from conftest import CUDA, interpreter_test, runs_kernel

from blockspec.layers.kernels.sample import BLOCK, sample_triton
from blockspec.sampling import SAMPLING_COLUMNS, draw, probs, sample_rows

test_kernels_in_interpreter = interpreter_test(__file__)
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.bfloat16, torch.float32] if CUDA else [torch.float32]


def reference(logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    sampling = torch.zeros(len(temperature), len(SAMPLING_COLUMNS), device=logits.device)
    sampling[:, 0] = temperature
    return draw(probs(logits, sampling, filters=False), u)


def case(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(rows, vocab, generator=gen)).to(DEVICE, dtype)
    temperature = torch.tensor([0.0, 1e-4, 0.05, 0.7, 1.0, 1.5])[torch.arange(rows) % 6].to(DEVICE)
    u = torch.rand(rows, generator=gen, dtype=torch.float64).to(DEVICE)
    return logits, temperature, u


@runs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (5, 17), (7, BLOCK + 1), (16, 3 * BLOCK - 5), (2, 49152)])
def test_sample_matches_the_reference_draw(shape, dtype):
    logits, temperature, u = case(*shape, dtype, seed=shape[-1])
    tokens = sample_triton(logits, temperature, u)
    assert tokens.dtype == torch.int64 and torch.equal(tokens, reference(logits, temperature, u))


@runs_kernel
def test_a_row_draws_alone_as_beside_any_rows():
    """Row invariance: a row is cut into the same chunks whatever the batch (`chunk_layout` reads the
    vocabulary alone), and its programs read only its own logits and sums: alone or in any slice of
    a batch, the same token."""
    logits, temperature, u = case(33, 5 * BLOCK + 3, torch.float32, seed=3)
    together = sample_triton(logits, temperature, u)
    for rows in (slice(0, 1), slice(5, 6), slice(3, 11), slice(32, 33)):
        assert torch.equal(sample_triton(logits[rows], temperature[rows], u[rows]), together[rows])


@runs_kernel
def test_rows_of_a_wider_tensor():
    """A plain step's rows: logits[:, 0] of [B, S, V], its rows S * V apart."""
    logits, temperature, u = case(6, 3 * BLOCK + 1, torch.float32, seed=2)
    wide = torch.stack([logits, logits.flip(-1)], 1)[:, 0]
    assert wide.stride(0) == 2 * logits.shape[1]
    assert torch.equal(sample_triton(wide, temperature, u), reference(logits, temperature, u))


@runs_kernel
def test_a_drafters_rows_take_their_sequences_temperature():
    """`rows_per_t`: a drafter's n rows a sequence, row r at temperature[r // n] (`sampling.sample_drafts`),
    as the reference with each sequence's temperature repeated per row."""
    logits, temperature, u = case(4 * 3, 2 * BLOCK + 5, torch.float32, seed=4)
    per_sequence = temperature[::3]
    tokens = sample_triton(logits, per_sequence, u, rows_per_t=3)
    assert torch.equal(tokens, reference(logits, per_sequence.repeat_interleave(3), u))
    assert not torch.equal(tokens, reference(logits, per_sequence.repeat(3), u))


@runs_kernel
def test_masked_tokens_are_never_drawn_even_at_the_ends_of_the_uniforms():
    """Tokens at -inf (a grammar's or a ban's) have no mass: u near 0 draws the first allowed token,
    u near 1 the last, whichever chunk they sit in."""
    V = 5 * BLOCK + 3
    logits = torch.full((4, V), float("-inf"), device=DEVICE)
    allowed = [[7, 2 * BLOCK + 1], [V - 1], [0, BLOCK, 4 * BLOCK], [3 * BLOCK - 1, 3 * BLOCK]]
    for row, tokens in enumerate(allowed):
        logits[row, tokens] = torch.arange(len(tokens), dtype=torch.float32, device=DEVICE)
    temperature = torch.ones(4, device=DEVICE)
    for u_value, pick in ((0.0, 0), (1 - 2**-53, -1)):
        u = torch.full((4,), u_value, dtype=torch.float64, device=DEVICE)
        expected = [tokens[pick] for tokens in allowed]
        assert sample_triton(logits, temperature, u).tolist() == expected
        assert reference(logits, temperature, u).tolist() == expected


@runs_kernel
def test_a_wrong_temperature_draws_other_tokens():
    """The comparison can fail: the same uniforms at another temperature give other tokens."""
    logits, temperature, u = case(64, 2 * BLOCK, torch.float32, seed=1)
    tokens = sample_triton(logits, temperature, u)
    assert not torch.equal(tokens, reference(logits, temperature + 0.5, u))
    assert sample_triton(logits[:0], temperature[:0], u[:0]).shape == (0,)


@pytest.mark.skipif(not CUDA, reason="the dispatch to the kernel is CUDA's")
def test_sample_rows_dispatches_to_the_kernel(monkeypatch):
    from blockspec.layers.kernels import sample as kernel

    calls = []
    monkeypatch.setattr(kernel, "sample_triton", lambda *args: calls.append(args) or torch.zeros(2))
    sampling = torch.ones(2, len(SAMPLING_COLUMNS), device=DEVICE)
    with torch.inference_mode():
        sample_rows(torch.randn(2, 10, device=DEVICE), sampling, torch.rand(2, dtype=torch.float64, device=DEVICE))
    assert len(calls) == 1
