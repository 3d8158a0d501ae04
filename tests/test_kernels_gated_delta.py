"""The Triton gated delta rule on slot-indexed states (`gated_delta_rule_in_slots` on CUDA)
against the reference: outputs, the states written back at their slots, fresh sequences, rows past
a sequence's count, inputs that are views of one convolution output, and the per-row states of
the rollback bench. On the CPU it runs in Triton's interpreter (test_kernels_in_interpreter)."""

import pytest
import torch

pytest.importorskip("triton")

from conftest import CUDA, interpreter_test, runs_kernel

from blockspec.layers.gated_deltanet import gated_delta_rule_in_slots, gated_delta_rule_ref
from blockspec.layers.kernels.gated_delta import recurrent_in_slots
from blockspec.layers.recurrent_state import RecurrentStates

test_kernels_in_interpreter = interpreter_test(__file__)
DEVICE = torch.device("cuda" if CUDA else "cpu")
B, HK, HV, DK, DV, SLOTS = 5, 2, 4, 16, 16, 6  # DV: two value blocks of a head (BLOCK_V 8)


def inputs(T: int, dtype: torch.dtype, seed: int = 0):
    """q, k, v as views of one convolution output [B, T, C] (as the layer has them)."""
    gen = torch.Generator().manual_seed(seed)
    conv = torch.randn(B, T, 2 * HK * DK + HV * DV, generator=gen).to(DEVICE, dtype)
    q, k, v = conv.split([HK * DK, HK * DK, HV * DV], dim=-1)
    q, k, v = q.unflatten(-1, (HK, DK)), k.unflatten(-1, (HK, DK)), v.unflatten(-1, (HV, DV))
    g = (-torch.rand(B, T, HV, generator=gen)).to(DEVICE)
    beta = torch.rand(B, T, HV, generator=gen).to(DEVICE, dtype)
    pool = torch.randn(SLOTS, HV, DK, DV, generator=gen).to(DEVICE)
    return q, k, v, g, beta, pool


def states(rows: list[int], T: int) -> tuple[RecurrentStates, torch.Tensor]:
    """Slots 3, 1, 5 and two padding sequences in the trash slot 0, the second starting at position
    0, each of T rows; the starts a strided column (as a step launched ahead passes them); and
    `rows` as a tensor."""
    slots, lengths, rows = (torch.tensor(x, device=DEVICE) for x in ([3, 1, 5, 0, 0], [T] * B, rows))
    packed = torch.tensor([[9, 7, 1], [9, 0, 1], [9, 2, 1], [9, 0, 1], [9, 0, 1]], device=DEVICE)
    return RecurrentStates(slots, packed[:, 1], lengths), rows


@runs_kernel
@pytest.mark.parametrize("T", [1, 5, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("write", [False, True])
def test_recurrence_in_slots_equals_the_reference(T, dtype, write):
    q, k, v, g, beta, pool = inputs(T, dtype, seed=T)
    st, rows = states([T, max(T - 2, 1), T + 3, 0, 0], T)  # a count past the block leaves the rest as is
    ref_pool, pool_ = pool.clone(), pool.clone()
    ref = gated_delta_rule_in_slots(q, k, v, g, beta, ref_pool, st, rows, write=write)  # grad on: the reference
    out = recurrent_in_slots(q, k, v, g, beta, pool_, st.slots, st.starts, rows, write=write)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    real = st.slots[:3]  # the trash slot takes the padding sequences' (unread) states
    torch.testing.assert_close(pool_[real], ref_pool[real], atol=1e-5, rtol=1e-5)
    untouched = [2, 4]
    assert torch.equal(pool_[untouched], pool[untouched])
    if not write:
        assert torch.equal(pool_, pool)


@runs_kernel
def test_replay_without_outputs_writes_the_state_after_the_counted_rows():
    """The rollback's replay: no outputs, the state after rows[b] rows of the block, equal to a
    forward over those rows alone (the reference recurrence, from the slot's state)."""
    T = 6
    q, k, v, g, beta, pool = inputs(T, torch.float32, seed=1)
    st, rows = states([0, 3, 6, 2, 0], T)
    written = pool.clone()
    assert recurrent_in_slots(q, k, v, g, beta, written, st.slots, st.starts, rows, outputs=False, write=True) is None
    initial = st.initial(pool)
    for b, n in enumerate(rows.tolist()[:3]):
        _, alone = gated_delta_rule_ref(*(x[b : b + 1, :n] for x in (q, k, v, g, beta)), initial[b : b + 1])
        torch.testing.assert_close(written[st.slots[b]], alone[0], atol=1e-5, rtol=1e-5)


@runs_kernel
def test_row_states_are_the_states_after_each_row():
    T = 5
    q, k, v, g, beta, pool = inputs(T, torch.float32, seed=2)
    st, rows = states([T] * B, T)
    row_states = torch.empty(B, T, HV, DK, DV, device=DEVICE)
    recurrent_in_slots(q, k, v, g, beta, pool, st.slots, st.starts, rows, row_states=row_states)
    initial = st.initial(pool)
    for n in range(1, T + 1):
        _, after = gated_delta_rule_ref(*(x[:, :n] for x in (q, k, v, g, beta)), initial)
        torch.testing.assert_close(row_states[:3, n - 1], after[:3], atol=1e-5, rtol=1e-5)
