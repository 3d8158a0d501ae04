"""Speculative sampling's acceptance test and residual draw in Triton (`blockspec.sampling.sample_block`
on CUDA) against a reference made of the engine's own primitives (`probs` of both logits,
`sampled_accept`, `residual_tokens`): the same accepted drafts and the same token for every
sequence, over chunk boundaries, temperatures (0 taking 1), drafts cut short, every draft
accepted, masked tokens and uniforms at the ends of [0, 1). On the CPU it runs in Triton's
interpreter (test_kernels_in_interpreter, as in test_kernels_sample)."""

from dataclasses import dataclass, replace

import pytest
import torch

pytest.importorskip("triton")

from conftest import CUDA, interpreter_test, runs_kernel

from blockspec.layers.kernels.sample import BLOCK
from blockspec.layers.kernels.speculative_sample import speculative_sample_triton
from blockspec.sampling import (
    SAMPLING_COLUMNS,
    acceptance_chances,
    draw,
    probs,
    residual_tokens,
    sample_block,
    sampled_accept,
)

test_kernels_in_interpreter = interpreter_test(__file__)
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.bfloat16, torch.float32] if CUDA else [torch.float32]


@dataclass
class Block:
    logits: torch.Tensor  # [B, S, V] the target's
    draft_logits: torch.Tensor  # [B, S-1, V] the drafter's
    drafts: torch.Tensor  # [B, S-1] drawn from softmax(draft_logits / T)
    num_drafts: torch.Tensor  # [B]
    temperature: torch.Tensor  # [B]
    u_accept: torch.Tensor  # [B, S-1]
    u_residual: torch.Tensor  # [B, S]

    def sampling(self) -> torch.Tensor:
        rows = torch.zeros(len(self.temperature), len(SAMPLING_COLUMNS), device=DEVICE)
        rows[:, 0] = self.temperature
        return rows

    imposed: torch.Tensor | None = None  # [B] counts replacing the test's (a simulated proposal's)

    def kernel(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = speculative_sample_triton(
            self.logits, self.draft_logits, self.drafts, self.num_drafts, self.temperature, self.u_accept,
            self.u_residual, self.imposed,
        )  # fmt: skip
        return out.accepted, out.token

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        p = probs(self.logits, self.sampling()[:, None], filters=False)
        q = probs(self.draft_logits, self.sampling()[:, None], filters=False)
        accepted = sampled_accept(self.drafts, p, q, self.num_drafts, self.u_accept)
        accepted = accepted if self.imposed is None else self.imposed
        u = self.u_residual.gather(1, accepted[:, None])[:, 0]
        return accepted, residual_tokens(accepted, p, q, self.num_drafts, u)

    def rows(self, seqs: slice) -> "Block":
        return Block(**{name: None if value is None else value[seqs] for name, value in vars(self).items()})


def case(B: int, S: int, V: int, dtype: torch.dtype, seed: int, noise: float = 1.5) -> Block:
    """B sequences of S rows: the drafter's logits the target's plus `noise`, drafts drawn from them."""
    gen = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(B, S, V, generator=gen)
    draft_logits = logits[:, :-1] + noise * torch.randn(B, S - 1, V, generator=gen)
    temperature = torch.tensor([0.7, 1.0, 0.0, 1.5, 0.05, 0.3])[torch.arange(B) % 6]
    logits, draft_logits, temperature = logits.to(DEVICE, dtype), draft_logits.to(DEVICE, dtype), temperature.to(DEVICE)
    block = Block(logits, draft_logits, None, None, temperature, None, None)
    q = probs(draft_logits, block.sampling()[:, None], filters=False)
    block.drafts = draw(q, torch.rand(B, S - 1, generator=gen, dtype=torch.float64).to(DEVICE))
    block.num_drafts = torch.randint(0, S, (B,), generator=gen).to(DEVICE)
    block.u_accept = torch.rand(B, S - 1, generator=gen, dtype=torch.float64).to(DEVICE)
    block.u_residual = torch.rand(B, S, generator=gen, dtype=torch.float64).to(DEVICE)
    return block


def assert_matches(block: Block) -> None:
    accepted, token = block.kernel()
    expected_accepted, expected_token = block.reference()
    assert accepted.dtype == token.dtype == torch.int64
    assert torch.equal(accepted, expected_accepted)
    assert torch.equal(token, expected_token)


@runs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 2, 1), (3, 2, 17), (6, 5, BLOCK + 1), (5, 16, 3 * BLOCK - 5), (2, 4, 49152)])
def test_accepts_and_draws_as_the_reference(shape, dtype):
    block = case(*shape, dtype, seed=shape[-1])
    assert_matches(block)
    accepted, _ = block.kernel()
    assert (accepted <= block.num_drafts).all()


@runs_kernel
def test_drafts_are_rejected_and_accepted_across_the_batch():
    """A batch where drafts are rejected at once, later, and never: every path of the kernels runs."""
    block = case(48, 5, 2 * BLOCK + 7, torch.float32, seed=1, noise=0.6)
    block.num_drafts.fill_(4)
    accepted, _ = block.kernel()
    assert {0, 1, 4} <= set(accepted.tolist())
    assert_matches(block)


@runs_kernel
def test_the_drafters_own_distribution_is_always_accepted():
    """q == p: every draft up to the cut is accepted, and the token is drawn from p's next row. At a
    uniform of 1 (outside [0, 1), to reach the guard) the first draft is rejected, and its residual
    max(p - q, 0) has no mass: the token is drawn from p, as the reference does."""
    block = case(12, 6, BLOCK + 9, torch.float32, seed=2, noise=0.0)
    accepted, _ = block.kernel()
    assert torch.equal(accepted, block.num_drafts)
    assert_matches(block)
    guard = replace(block, u_accept=torch.ones_like(block.u_accept))
    accepted, token = guard.kernel()
    assert accepted.tolist() == [0] * 12
    p = probs(block.logits[:, 0], block.sampling(), filters=False)
    assert torch.equal(token, draw(p, block.u_residual[:, 0]))
    assert_matches(guard)


@runs_kernel
def test_logits_shared_by_rows_that_differ_keep_their_residual():
    """The drafter's logits equal the target's at most tokens but not all, so the rows' totals
    differ and p != q at the shared tokens too: their residual max(p - q, 0) stays (p == q is taken
    only for equal logits of rows with equal chunk stats), at every draft rejected or not."""
    block = case(12, 6, 2 * BLOCK + 9, torch.float32, seed=3, noise=0.0)
    block.draft_logits[..., : BLOCK // 2] += 1.0
    for u_accept in (block.u_accept, torch.ones_like(block.u_accept)):
        assert_matches(replace(block, u_accept=u_accept))


@runs_kernel
def test_imposed_counts_replace_the_tests():
    """A simulated proposal's counts (benchmarks): the test still runs, and the token is drawn after
    the imposed count, from its row's residual (p's after a full block)."""
    block = case(16, 5, 2 * BLOCK + 1, torch.float32, seed=8)
    block.num_drafts.fill_(4)
    block.imposed = torch.arange(16, device=DEVICE) % 5
    accepted, token = block.kernel()
    assert torch.equal(accepted, block.imposed)
    assert_matches(block)
    assert not torch.equal(token, replace(block, imposed=None).kernel()[1])


@runs_kernel
def test_a_sequence_alone_as_beside_any_others():
    """Each sequence reads only its own rows and their sums: alone or in any slice of a batch, the
    same drafts accepted and the same token."""
    block = case(11, 4, 3 * BLOCK + 2, torch.float32, seed=4)
    together = block.kernel()
    for seqs in (slice(0, 1), slice(4, 5), slice(2, 9), slice(10, 11)):
        alone = block.rows(seqs).kernel()
        assert torch.equal(alone[0], together[0][seqs]) and torch.equal(alone[1], together[1][seqs])


@runs_kernel
def test_masked_tokens_are_never_drawn():
    """Tokens at -inf in both the target's and the drafter's logits (a ban, say) have no mass in p,
    q or the residual: never drawn, at uniforms near 0 and near 1 too; a chunk at -inf in the
    drafter's alone is p's in the residual. At 0 the token is the first
    of any mass, as the reference's; near 1 it may differ from the reference's where a float32 sum
    rounds apart from its float64 ones (`sampling.draw`)."""
    block = case(16, 4, 2 * BLOCK + 3, torch.float32, seed=5)
    masked = torch.arange(0, block.logits.shape[-1], 3, device=DEVICE)
    block.logits[..., masked] = float("-inf")
    block.draft_logits[..., masked] = float("-inf")
    block.draft_logits[..., BLOCK : 2 * BLOCK] = float("-inf")  # a whole chunk q alone lacks (a draft vocabulary's)
    q = probs(block.draft_logits, block.sampling()[:, None], filters=False)
    near_0, near_1 = torch.zeros_like(block.u_residual), torch.full_like(block.u_residual, 1 - 2**-53)
    for u, as_reference in ((near_0, True), (near_1, False)):
        edge = replace(block, drafts=draw(q, u[:, 1:]), u_residual=u)
        accepted, token = edge.kernel()
        assert not torch.isin(token, masked).any()
        assert torch.equal(accepted, edge.reference()[0])
        assert torch.equal(token, edge.reference()[1]) or not as_reference


@runs_kernel
def test_a_wrong_rule_gives_other_results():
    """The comparisons can fail: drafts tested at 1 - u, or drawn after from p alone, differ."""
    block = case(64, 5, 2 * BLOCK, torch.float32, seed=6, noise=1.0)
    block.num_drafts.fill_(4)
    accepted, token = block.kernel()
    flipped, _ = replace(block, u_accept=1 - block.u_accept).reference()
    assert not torch.equal(accepted, flipped)
    p = probs(block.logits, block.sampling()[:, None], filters=False)
    u = block.u_residual.gather(1, accepted[:, None])[:, 0]
    from_p = draw(p.gather(1, accepted[:, None, None].expand(-1, 1, p.shape[-1]))[:, 0], u)
    assert not torch.equal(token, from_p)


@pytest.mark.skipif(not CUDA, reason="the dispatch to the kernel is CUDA's")
def test_sample_block_dispatches_to_the_kernel(monkeypatch):
    from blockspec.layers.kernels import speculative_sample as kernel

    calls = []
    monkeypatch.setattr(kernel, "speculative_sample_triton", lambda *args: calls.append(args) or (None, None))
    block = case(2, 3, 10, torch.float32, seed=7)
    with torch.inference_mode():
        sample_block(block.logits, block.draft_logits, None, block.drafts, block.num_drafts, block.sampling(),
                     block.u_accept, block.u_residual)  # fmt: skip
    assert len(calls) == 1


@runs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 3, 17), (6, 5, BLOCK + 1), (5, 16, 3 * BLOCK - 5), (48, 5, 2 * BLOCK + 7)])
def test_chances_of_the_drafts_reached_as_the_reference(shape, dtype):
    """With `chances`, sum min(p, q) of each draft reached (0 past them, and past a cut) as the
    reference computes it, to float32 rounding; the counts and tokens are those without."""
    block = case(*shape, dtype, seed=shape[-1] + 1, noise=0.6)
    out = speculative_sample_triton(
        block.logits, block.draft_logits, block.drafts, block.num_drafts, block.temperature, block.u_accept,
        block.u_residual, None, True,
    )  # fmt: skip
    accepted, token = block.kernel()
    assert torch.equal(out.accepted, accepted) and torch.equal(out.token, token)
    p = probs(block.logits, block.sampling()[:, None], filters=False)
    q = probs(block.draft_logits, block.sampling()[:, None], filters=False)
    expected = acceptance_chances(p, q, torch.minimum(out.accepted + 1, block.num_drafts))
    assert out.chances.dtype == torch.float32 and out.chances.shape == block.drafts.shape
    assert torch.allclose(out.chances, expected, atol=1e-5, rtol=0)
    assert (expected[:, 1:] > 0).any()  # drafts past the first are reached
