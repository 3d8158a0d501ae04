"""The Triton argmax (`blockspec.sampling.argmax` on CUDA) against torch's: the first index of
each row's maximum, over chunk boundaries, ties, rows of -inf and NaN. On the CPU it runs in
Triton's interpreter (test_kernels_in_interpreter, as in test_kernels_attention)."""

import pytest
import torch

pytest.importorskip("triton")

from conftest import CUDA, interpreter_test, runs_kernel

from blockspec.layers.kernels import num_sms
from blockspec.layers.kernels.argmax import BLOCK, argmax_triton, chunk_iters
from blockspec.sampling import argmax

test_kernels_in_interpreter = interpreter_test(__file__)
DEVICE = torch.device("cuda" if CUDA else "cpu")


@runs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1), (3, 17), (2, 5, 4097), (16, 151936), (70, 3 * BLOCK + 5)])
def test_argmax_matches_torch(shape, dtype):
    torch.manual_seed(shape[-1])
    x = torch.randn(shape, device=DEVICE).to(dtype)
    assert torch.equal(argmax_triton(x), x.argmax(dim=-1))


@runs_kernel
def test_ties_take_the_first_index_across_chunks():
    V = 40 * BLOCK + 7
    chunk = chunk_iters(5, V, num_sms(DEVICE, interpreted=4)) * BLOCK  # as argmax_triton cuts a row
    assert V > 3 * chunk
    x = torch.zeros(5, V, device=DEVICE)
    x[0, [V - 1, 2 * chunk + 3, chunk + 1]] = 2.0  # in three chunks: the first wins
    x[1] = 7.0  # all equal: index 0
    x[2] = float("-inf")  # nothing finite: index 0, as torch
    x[3, [chunk - 1, chunk]] = float("inf")  # the last of one chunk against the first of the next
    x[4, 5 * BLOCK] = float("nan")  # NaN above everything finite
    assert argmax_triton(x).tolist() == [chunk + 1, 0, 0, chunk - 1, 5 * BLOCK]
    assert torch.equal(argmax_triton(x), x.argmax(dim=-1))


@runs_kernel
def test_strided_rows_and_empty_batches():
    x = torch.randn(6, 300, device=DEVICE)
    view = x[::2, 10:250]  # rows of a wider tensor, every other one
    assert torch.equal(argmax_triton(view), view.argmax(dim=-1))
    assert argmax_triton(x[:0]).shape == (0,)
    with pytest.raises(AssertionError, match="empty row"):
        argmax_triton(x[:, :0])
    with pytest.raises(AssertionError, match="float64"):  # compared in float32, it could tie wrongly
        argmax_triton(x.double())


@pytest.mark.skipif(not CUDA, reason="the dispatch to the kernel is CUDA's")
def test_sampling_argmax_dispatches_to_the_kernel(monkeypatch):
    from blockspec.layers.kernels import argmax as kernel

    calls = []
    monkeypatch.setattr(kernel, "argmax_triton", lambda x: calls.append(x) or x.argmax(dim=-1))
    with torch.inference_mode():
        argmax(torch.randn(2, 50, device="cuda"))
    assert len(calls) == 1
