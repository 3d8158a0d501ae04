"""DSpark's greedy Markov chain kernel (`blockspec.layers.kernels.markov_chain`, the CUDA path of
`DSparkProposer.markov_chain`) against the proposer's own loop: the same drafts and the same
Markov embeddings, over vocabulary chunks of several blocks, a rank that is not a whole number of
the kernel's rank blocks, a reduced draft vocabulary, and more sequences than a program takes. On the CPU it runs in Triton's
interpreter (test_kernels_in_interpreter)."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from conftest import CUDA, interpreter_test, make_dspark, make_target, runs_kernel

from blockspec.layers.fast_path import reference_ops
from blockspec.layers.kernels.markov_chain import greedy_chain
from blockspec.loading.drafters import load_drafter
from blockspec.loading.hf import load_target
from blockspec.proposers.dspark import DSparkProposer

test_kernels_in_interpreter = interpreter_test(__file__)
DEVICE = torch.device("cuda" if CUDA else "cpu")
VOCAB = 5000  # in the interpreter's 4 "SMs": 10 chunks of two 256-token blocks a row for one group


@runs_kernel
@pytest.mark.parametrize("draft_vocab,rank,B", [(None, 40, 2), (3000, 16, 18)])
def test_greedy_chain_matches_the_proposer_loop(tmp_path, draft_vocab, rank, B):
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
    with torch.inference_mode(), reference_ops():
        runner, inputs = SimpleNamespace(target=target), SimpleNamespace(tokens=anchor[:, None], sampling=None)
        proposal, expected = DSparkProposer(drafter).markov_chain(runner, inputs, hidden, base)
    with torch.inference_mode():
        w1, w2 = head.markov_w1.weight, head.markov_w2.weight
        drafts, embeddings = greedy_chain(base, anchor, w1, w2, drafter.draft_to_target, torch.bfloat16)
    assert drafts.tolist() == proposal.drafts.tolist()
    assert torch.equal(embeddings, expected)
    plain = base.float().argmax(-1)
    plain = drafter.draft_to_target[plain] if draft_vocab else plain
    assert not torch.equal(drafts, plain)  # the Markov bias moved some drafts


@runs_kernel
def test_empty_batch():
    w1, w2 = torch.randn(10, 4, device=DEVICE), torch.randn(10, 4, device=DEVICE)
    drafts, embeddings = greedy_chain(
        torch.randn(0, 3, 10, device=DEVICE),
        torch.zeros(0, dtype=torch.long, device=DEVICE),
        w1,
        w2,
        None,
        torch.float32,
    )
    assert drafts.shape == (0, 3) and embeddings.shape == (0, 3, 4)
