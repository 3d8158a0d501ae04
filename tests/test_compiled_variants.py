"""The CUDA fast path's torch.compile'd functions (`fast_path.cuda_compiled`) compile a variant
per shape class they meet; past torch's recompile limit a function runs eagerly for good, and
silently: every step graph captured after that holds its dozen eager kernels. Dynamo's guards do
not depend on the device, so the classes are counted here on the CPU (dynamo with the eager
backend), over the classes an engine's warm-up meets (from its recompile log on the GPU)."""

import itertools

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from blockspec.engine.batch import batch_rows
from blockspec.layers.fast_path import RECOMPILE_LIMIT

DEFAULT_LIMIT = 8  # torch's recompile_limit


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()  # drop this test's eager-backend variants of the engine's functions


def test_compiled_functions_compile_past_torchs_default_limit(fresh_dynamo):
    """batch_rows over batch 1 or more, width 1 or more, one page-table column or more, inputs at
    storage offset 0 (graph buffers) or past it (views of the host's one copy; torch 2.11, the
    GPU's, specializes offsets 0 and 1, later versions not), and int32 or int64 inputs (a class on
    every version, so that the grid outgrows the default limit anywhere): each class compiled,
    none left to the eager fallback, each equal to the reference."""
    assert torch._dynamo.config.recompile_limit >= RECOMPILE_LIMIT  # set when fast_path compiled its functions
    compiled = torch.compile(batch_rows.eager, dynamic=True, backend="eager")
    g = torch.Generator().manual_seed(0)
    for batch, width, columns, offset, dtype in itertools.product(
        (1, 3), (1, 16), (1, 7), (0, 2), (torch.int32, torch.int64)
    ):
        host = torch.randint(0, 40, (offset + batch,), generator=g, dtype=dtype)
        starts = host[offset:]  # a view at `offset`, as `ModelRunner.tensors` makes
        lengths = torch.randint(1, width + 1, (batch,), generator=g)
        block_tables = torch.randint(1, 100, (batch, 2, columns), generator=g)
        page_size = 64 if columns == 1 else 16  # every position falls inside the table
        got = compiled(starts, lengths, block_tables, width, page_size)
        want = batch_rows.eager(starts, lengths, block_tables, width, page_size)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert counters["stats"]["unique_graphs"] > DEFAULT_LIMIT
    assert not [reason for reason in counters["unimplemented"] if "recompile limit" in reason.lower()]
