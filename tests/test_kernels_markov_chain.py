"""DSpark's Markov chain kernel (`blockspec.layers.kernels.markov_chain`, the CUDA path of
`DSparkProposer.markov_chain`) against the proposer's own loop, greedy and sampled (greedy and
sampled sequences in one batch): the same drafts, the same Markov embeddings and the same q, over
vocabulary chunks of several blocks, a rank that is not a whole number of the kernel's rank
blocks, a reduced draft vocabulary, and more sequences than a program takes. On the CPU it runs in
Triton's interpreter (test_kernels_in_interpreter)."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from conftest import CUDA, interpreter_test, make_dspark, make_target, runs_kernel

from blockspec.layers.fast_path import reference_ops
from blockspec.layers.kernels.markov_chain import ChainTiles, chain_tiles, markov_chain
from blockspec.loading.drafters import load_drafter
from blockspec.loading.hf import load_target
from blockspec.proposers.dspark import DSparkProposer
from blockspec.sampling import Stream, uniform

test_kernels_in_interpreter = interpreter_test(__file__)
DEVICE = torch.device("cuda" if CUDA else "cpu")
VOCAB = 5000  # in the interpreter's 4 "SMs": 10 chunks of two 256-token blocks a row for one group
# tl.dot over 16 sequences a program; multiply-adds over 4 (more groups, 64-token blocks); on CUDA
# also bf16 tensor cores (Triton's interpreter mishandles a bf16 dot) and the tiles `markov_chain` picks
TILES = [ChainTiles(), ChainTiles(seqs=4, block=64, rank_block=16, programs_per_sm=2)]
TILES += [pytest.param(t, marks=pytest.mark.skipif(not CUDA, reason="CUDA")) for t in (ChainTiles(mma=True), None)]


def chain_inputs(anchor: torch.Tensor, n: int, temperatures: list[float] | None) -> SimpleNamespace:
    """The proposer's step inputs: greedy (None), or sampled at these temperatures (0: a greedy
    sequence in a sampled batch), without top-k, top-p or min-p."""
    if temperatures is None:
        return SimpleNamespace(tokens=anchor[:, None], sampling=None)
    B, device = len(temperatures), anchor.device
    params = torch.tensor([[t, 0.0, 1.0, 0.0] for t in temperatures], device=device)
    positions = torch.arange(B, device=device)[:, None] * 100 + torch.arange(1, n + 1, device=device)
    seeds = torch.arange(B, device=device) * 7919 + 11
    return SimpleNamespace(
        tokens=anchor[:, None], sampling=True, sampling_params=params, filters=False, greedy=params[:, 0] == 0,
        seeds=seeds, draft_positions=positions,
    )  # fmt: skip


@runs_kernel
@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("draft_vocab,rank,B", [(None, 40, 2), (3000, 16, 18)])
@pytest.mark.parametrize("tiles", TILES, ids=["dot", "fma", "mma", "chosen"])
def test_chain_matches_the_proposer_loop(tmp_path, draft_vocab, rank, B, sampled, tiles):
    check_chain(tmp_path, draft_vocab, rank, B, sampled, tiles)


@runs_kernel
@pytest.mark.parametrize("sampled", [False, True])
def test_one_sequence_takes_its_own_tiles(tmp_path, sampled):
    """A decode at batch 1: the tiles `markov_chain` picks for one sequence (a program per 64
    tokens, the whole rank a load, multiply-adds on the CUDA cores)."""
    assert chain_tiles(1, torch.empty(0)) == ChainTiles(1, 64, 256, 64, 2048)
    check_chain(tmp_path, None, 40, 1, sampled, None)


def check_chain(tmp_path, draft_vocab: int | None, rank: int, B: int, sampled: bool, tiles: ChainTiles | None):
    """The kernel's chain (with `tiles`, None: its own choice) against the proposer's loop: the
    same drafts and embeddings, q within 1e-5, and sampled rows drawing tokens other than their mode."""
    tpath = make_target(tmp_path / "t", "qwen3", vocab=VOCAB, layers=4)
    dpath = make_dspark(
        tmp_path / "d", tpath, block_size=6, markov_rank=rank, draft_vocab=draft_vocab, markov_scale=30.0
    )
    target = load_target(tpath, torch.bfloat16, DEVICE).model
    drafter = load_drafter(dpath, target, torch.bfloat16, DEVICE)
    head, vd = drafter.markov_head, drafter.draft_vocab_size
    gen = torch.Generator().manual_seed(0)
    n = drafter.num_drafts
    base = torch.randn(B, n, vd, generator=gen).mul(3).to(torch.bfloat16).to(DEVICE)
    anchor = torch.randint(0, VOCAB, (B,), generator=gen).to(DEVICE)
    hidden = torch.zeros(B, n, 64, dtype=torch.bfloat16, device=DEVICE)  # read by gated and rnn heads only
    inputs = chain_inputs(anchor, n, [(4.0, 0.0, 1.0, 0.7)[i % 4] for i in range(B)] if sampled else None)
    with torch.inference_mode(), reference_ops():
        proposal, expected = DSparkProposer(drafter).markov_chain(SimpleNamespace(target=target), inputs, hidden, base)
    temperature, u = None, None
    if sampled:
        temperature = inputs.sampling_params[:, 0]
        u = uniform(inputs.seeds[:, None], inputs.draft_positions, Stream.DRAFT)
    with torch.inference_mode():
        w1, w2 = head.markov_w1.weight, head.markov_w2.weight
        chain = markov_chain(base, anchor, w1, w2, drafter.draft_to_target, torch.bfloat16, temperature, u, tiles)
    assert chain.drafts.tolist() == proposal.drafts.tolist()
    assert torch.equal(chain.embeddings, expected)
    plain = base.float().argmax(-1)
    plain = drafter.draft_to_target[plain] if draft_vocab else plain
    assert not torch.equal(chain.drafts, plain)  # the Markov bias (and the draws) moved some drafts
    if not sampled:
        assert chain.q is None
        return
    q = drafter.to_target(chain.q, target, fill=0.0)
    torch.testing.assert_close(q, proposal.q, rtol=1e-5, atol=1e-7)
    drawn = ~inputs.greedy[:, None] & (chain.drafts != q.argmax(-1))
    assert drawn.any()  # sampled rows drew tokens other than their mode


@runs_kernel
def test_empty_batch():
    w1, w2 = torch.randn(10, 4, device=DEVICE), torch.randn(10, 4, device=DEVICE)
    drafts, embeddings, _ = markov_chain(
        torch.randn(0, 3, 10, device=DEVICE),
        torch.zeros(0, dtype=torch.long, device=DEVICE),
        w1,
        w2,
        None,
        torch.float32,
    )
    assert drafts.shape == (0, 3) and embeddings.shape == (0, 3, 4)
