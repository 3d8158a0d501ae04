"""Published DFlash-family drafters (tests/fixtures/drafters: their config.json and tensor names,
shapes and dtypes; SOURCES.md says where each came from) build on the meta device against their
targets' configs, with every checkpoint tensor used and none missing, read in the row convention
and vocabulary their trainers used."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import meta_tensors
from transformers import LlamaConfig, Qwen3Config

from blockspec.loading.drafters import build_drafter

FIXTURES = Path(__file__).parent / "fixtures" / "drafters"


def qwen3(hidden: int, layers: int, vocab: int = 151936) -> Qwen3Config:
    return Qwen3Config(hidden_size=hidden, num_hidden_layers=layers, vocab_size=vocab)


# The target geometry each drafter reads: its hidden size (fc's inputs), depth (layer ids) and vocabulary.
TARGETS = {
    "Qwen3-4B": qwen3(2560, 36),
    "Qwen3-8B": qwen3(4096, 36),
    "Qwen3-14B": qwen3(5120, 40),
    "Qwen3.8-27B": qwen3(5120, 64, 248320),
    "Llama-3.1-8B": LlamaConfig(hidden_size=4096, num_hidden_layers=32, vocab_size=128256),
    "z-lab-fixture-target": qwen3(6656, 52, 202048),  # the geometry z-lab's DFlash2 fixture reads
    "Qwen3-Coder-30B-A3B": qwen3(2048, 48),
    "gpt-oss-20b": qwen3(2880, 24, 201088),
    "gpt-oss-120b": qwen3(2880, 36, 201088),
    "Qwen3.5-4B": qwen3(2560, 32, 248320),
    "Qwen3.6-27B": qwen3(5120, 64, 248320),
    "Qwen3.6-35B-A3B": qwen3(2048, 40, 248320),
}

# folder -> (target, kind, shifted, drafts a block, draft vocabulary, Markov rank, confidence head)
EXPECTED = {
    "deepseek-ai--dspark_qwen3_4b_block7": ("Qwen3-4B", "dspark", True, 7, 151936, 256, True),
    "deepseek-ai--dspark_qwen3_8b_block7": ("Qwen3-8B", "dspark", True, 7, 151936, 256, True),
    "deepseek-ai--dspark_qwen3_14b_block7": ("Qwen3-14B", "dspark", True, 7, 151936, 256, True),
    "deepseek-ai--dflash_qwen3_4b_block7": ("Qwen3-4B", "dspark", True, 7, 151936, 0, False),
    "deepseek-ai--dflash_qwen3_8b_block7": ("Qwen3-8B", "dspark", True, 7, 151936, 0, False),
    "deepseek-ai--dflash_qwen3_14b_block7": ("Qwen3-14B", "dspark", True, 7, 151936, 0, False),
    "z-lab--Qwen3-8B-DFlash-b16": ("Qwen3-8B", "dflash", False, 15, 151936, None, None),
    "z-lab--LLaMA3.1-8B-Instruct-DFlash-UltraChat": ("Llama-3.1-8B", "dflash", False, 9, 128256, None, None),
    "RedHatAI--Qwen3-8B-speculator.dflash": ("Qwen3-8B", "dflash", False, 7, 32000, None, None),
    "RadixArk--Qwen3.8-27B-DSpark": ("Qwen3.8-27B", "dspark", True, 7, 248320, 256, True),
    "sgl-project--SpecForge--qwen3-4b-dspark": ("Qwen3-4B", "dspark", True, 7, 151936, 256, True),
    # DFlash2: (selector rank, top-k) in place of the Markov rank and confidence head
    "z-lab--dflash2-fixture": ("z-lab-fixture-target", "dflash2", False, 15, 202048, 256, 16),
    "z-lab--Qwen3.8-27B-DFlash2": ("Qwen3.8-27B", "dflash2", False, 7, 248320, 256, 16),
    # MoE targets' drafters (tests/fixtures/targets has the targets themselves)
    "z-lab--Qwen3-Coder-30B-A3B-DFlash": ("Qwen3-Coder-30B-A3B", "dflash", False, 15, 151936, None, None),
    "z-lab--gpt-oss-20b-DFlash": ("gpt-oss-20b", "dflash", False, 7, 201088, None, None),
    "z-lab--gpt-oss-120b-DFlash": ("gpt-oss-120b", "dflash", False, 9, 201088, None, None),
    # hybrid (Gated DeltaNet) targets' drafters: sliding layers, then one full
    "z-lab--Qwen3.5-4B-DFlash": ("Qwen3.5-4B", "dflash", False, 15, 248320, None, None),
    "z-lab--Qwen3.6-27B-DFlash": ("Qwen3.6-27B", "dflash", False, 15, 248320, None, None),
    "z-lab--Qwen3.6-35B-A3B-DFlash": ("Qwen3.6-35B-A3B", "dflash", False, 15, 248320, None, None),
}


def test_every_fixture_is_checked():
    assert sorted(p.name for p in FIXTURES.iterdir() if p.is_dir()) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_published_drafter_builds_with_every_tensor(name):
    folder = FIXTURES / name
    target_name, kind, shifted, drafts, draft_vocab, rank, confident = EXPECTED[name]
    target = SimpleNamespace(config=TARGETS[target_name])
    tensors = meta_tensors(folder)
    drafter, params, d2t, _ = build_drafter(json.loads((folder / "config.json").read_text()), tensors, target, folder)
    assert drafter.proposer == kind and drafter.shifted == shifted and drafter.num_drafts == drafts
    assert drafter.draft_vocab_size == draft_vocab
    if name.startswith("RedHatAI"):  # speculators counts HF's hidden states: its [2, 10, ..] are layers [1, 9, ..]
        assert drafter.target_layer_ids == (1, 9, 17, 25, 33)
    assert (d2t is not None) == (draft_vocab < target.config.vocab_size)
    if d2t is not None:
        assert d2t.shape == (draft_vocab,)
    if kind == "dspark":
        assert (drafter.markov_head.rank if drafter.markov_head is not None else 0) == rank
        assert (drafter.confidence_head is not None) == confident
    if kind == "dflash2":  # sliding layers, bidirectional (is_causal false), convolutions around every sublayer
        selector = drafter.candidate_selector
        assert (selector.predecessor_codebook.shape[1], selector.top_k) == (rank, confident)
        assert drafter.is_causal is False and drafter.sliding_window == 2048
        assert all(layer.attention_conv.taps == 2 for layer in drafter.layers)
    if target_name in ("Qwen3.5-4B", "Qwen3.6-27B", "Qwen3.6-35B-A3B"):  # windowed layers, then one full
        config = json.loads((folder / "config.json").read_text())
        assert drafter.sliding_window == config["sliding_window"] and drafter.layer_types[-1] == "full_attention"
    # every stored tensor is a parameter (build_drafter checks that every parameter is stored)
    assert len(params) + (d2t is not None) + ("t2d" in tensors) == len(tensors) - sum(
        ("q_proj" in n) * 2 + ("gate_proj" in n and ".mlp." in n) for n in tensors
    )
