"""The one-launch copy of a CUDA graph's integer inputs into its static buffers
(`kernels.graph_inputs`) against `fill_buffers`' reference, a copy and a fill per input. On the
CPU it runs in Triton's interpreter, in a subprocess (see test_kernels_attention)."""

import pytest
import torch

pytest.importorskip("triton")

from conftest import CUDA, interpreter_test, runs_kernel

from blockspec.engine.cuda_graphs import fill_buffers
from blockspec.engine.step import StepInputs
from blockspec.layers.fast_path import reference_ops
from blockspec.layers.kernels.graph_inputs import fill_buffers_triton

DEVICE = "cuda" if CUDA else "cpu"
test_kernels_in_interpreter = interpreter_test(__file__)


PAD = list(StepInputs.PAD.values())  # in StepInputs' field order, as step_inputs returns them


def step_inputs(batch: int, width: int, pages: int) -> tuple[torch.Tensor, ...]:
    """A step's inputs (`StepInputs`' tensors, in order) as a step launched ahead passes them: anchors
    expanded over the width (stride 0) and starts, both read from the step before's packed outcome
    (strided: columns 0 and 2), block tables of two cache groups, narrower than their buffer and
    not contiguous, and a sampled step's parameters (two int64 columns)."""
    gen = torch.Generator().manual_seed(batch)
    packed = torch.randint(0, 1000, (batch, 3 + width), generator=gen).to(DEVICE)
    tables = torch.randint(1, 99, (batch, 2, 2 * pages), generator=gen).to(DEVICE)[..., ::2]
    lengths, seeds = (torch.randint(1, width + 1, (batch,), generator=gen).to(DEVICE) for _ in range(2))
    sampling = torch.randint(0, 2**40, (batch, 2), generator=gen).to(DEVICE)
    return packed[:, :1].expand(-1, width), packed[:, 2], lengths, tables, seeds, sampling


@runs_kernel
@pytest.mark.parametrize("batch,bucket", [(1, 1), (3, 4), (4, 4)])
def test_fill_buffers_kernel_matches_copies(batch: int, bucket: int) -> None:
    """Every input in its buffer's first rows and columns, the padding rows set to PAD (and to a
    negative value, as min_tokens' stop ids pad), the columns past an input left as they were."""
    xs = step_inputs(batch, width=5, pages=3)
    pads = [*PAD[:5], -1]
    shapes = [(bucket, 8), (bucket,), (bucket,), (bucket, 2, 6), (bucket,), (bucket, 2)]
    bufs = [torch.full(s, -7, dtype=torch.int64, device=DEVICE) for s in shapes]
    expected = [b.clone() for b in bufs]
    with reference_ops():
        fill_buffers(expected, xs, pads, batch)
    fill_buffers_triton(bufs, list(xs), pads, batch)
    for got, want in zip(bufs, expected, strict=True):
        assert torch.equal(got, want)
    assert torch.equal(bufs[0][:batch, 5:], torch.full((batch, 3), -7, device=DEVICE))  # past the width: as it was
    assert torch.equal(bufs[3][:batch, :, :3], xs[3])  # each group's row in its own columns
    assert torch.equal(bufs[3][:batch, :, 3:], torch.full((batch, 2, 3), -7, device=DEVICE))
    assert torch.equal(bufs[3][batch:], torch.zeros(bucket - batch, 2, 6, dtype=torch.int64, device=DEVICE))
    assert torch.equal(bufs[5][batch:], torch.full((bucket - batch, 2), -1, device=DEVICE))
