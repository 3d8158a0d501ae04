"""Drafter training (the DFlash, DSpark and DFlash2 recipes) on tiny random targets: the mask, the
anchors, the training forwards against the engine's proposals and (DSpark's and DFlash2's losses)
dense references, resume, the CLI, data-parallel ranks, and real training runs whose drafters the
engine runs (DFlash's raising the mean acceptance length on held-out prompts)."""

import dataclasses
import json
import math
import os
import re
import signal
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import add_word_tokenizer, make_target
from safetensors.torch import load_file, save_file
from torch.utils.checkpoint import checkpoint
from transformers import AutoModelForCausalLM, Qwen3Config

from blockspec.cli import main as cli_main
from blockspec.layers.attention import DenseAttention
from blockspec.llm import LLM
from blockspec.loading.drafters import load_drafter, save_drafter
from blockspec.loading.finish import LoadOptions
from blockspec.loading.hf import load_target
from blockspec.loading.weights import CheckpointError
from blockspec.models.dflash import DFlashDrafter
from blockspec.models.dflash2 import DFlash2Drafter, DFlash2Layer
from blockspec.models.dspark import DSparkDrafter
from blockspec.outputs import CompletionOutput, RequestMetrics, RequestOutput
from blockspec.sampling import SamplingParams
from blockspec.train import TrainConfig, train
from blockspec.train import loss as loss_module
from blockspec.train import prompts as prompts_module
from blockspec.train.batches import Batch, collate
from blockspec.train.checkpoint import load_checkpoint, save_checkpoint
from blockspec.train.data import (
    Example,
    append_examples,
    generate_dataset,
    generate_examples,
    merge_parts,
    read_examples,
    token_prompts,
)
from blockspec.train.distributed import close_world, init_world
from blockspec.train.evaluate import acceptance_lengths
from blockspec.train.loss import (
    DSparkWeights,
    dflash2_loss,
    dflash_loss,
    dspark_loss,
    row_weights,
    sample_anchors,
    target_pass,
)
from blockspec.train.masks import FlexBlockAttention, block_mask, flex_block_mask
from blockspec.train.model import build_drafter
from blockspec.train.prompts import build_prompts, read_prompts
from blockspec.train.self_prompts import MIN_CHARS, target_prompts, user_turn
from blockspec.train.trainer import Trainer, step_loss

CPU = torch.device("cpu")
VOCAB, NEW_TOKENS, TRAIN, HELD_OUT = 64, 64, 512, 32


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # The CI machine has 2 shared cores: more threads than free cores makes these tiny models
    # ~30x slower (oversubscription), and one thread keeps the runs bitwise reproducible.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Path, Path, list[list[int]]]:
    """A tiny target (1 layer, tied embeddings: its greedy text has structure a drafter can
    learn; deeper random targets are chaotic), its own greedy responses to random token-id
    prompts as training data, and held-out prompts."""
    root = tmp_path_factory.mktemp("train")
    target = make_target(root / "target", "qwen3", tied=True, vocab=VOCAB, layers=1)
    llm = LLM(str(target), None, device="cpu", dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    examples = generate_examples(llm, token_prompts(VOCAB, TRAIN + HELD_OUT, seed=1), params)
    assert len(examples) == TRAIN + HELD_OUT
    append_examples(root / "data.jsonl", examples[:TRAIN])
    return target, root / "data.jsonl", [e.prompt_ids for e in examples[TRAIN:]]


def config(target: Path, data: Path | None, out: Path, **overrides) -> TrainConfig:
    base = {"model": str(target), "output": str(out), "device": "cpu", "data": data and str(data), "layers": 1}
    base |= {"block_size": 8, "steps": 300, "batch_size": 16, "blocks_per_seq": 16, "lr": 3e-3, "log_every": 50}
    return TrainConfig(**(base | {"save_dtype": "float32"} | overrides))


def dspark_drafter(target, cfg: TrainConfig) -> DSparkDrafter:
    """A fresh DSpark drafter whose Markov bias moves the argmax (at its init it hardly shows), so
    that a bias read from another token than the one before the draft changes the drafts."""
    drafter, _ = build_drafter(target, cfg, VOCAB - 1)
    assert isinstance(drafter, DSparkDrafter) and drafter.markov_head is not None
    with torch.no_grad():
        drafter.markov_head.markov_w2.weight.mul_(100)
    return drafter


TERMS = DSparkWeights(ce=0.1, l1=0.9, confidence=1.0)


def dflash2_drafter(target, cfg: TrainConfig) -> DFlash2Drafter:
    """A fresh DFlash2 drafter whose convolutions are not the identity and whose selector's pair
    scores move its choice (at init, a zero successor codebook gives none), so that a convolution
    reaching another block or a score read against another predecessor changes the results."""
    drafter, _ = build_drafter(target, cfg, VOCAB - 1)
    assert isinstance(drafter, DFlash2Drafter) and drafter.candidate_selector is not None
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "_conv." in name or "successor" in name:
                p.add_(torch.randn(p.shape, generator=generator) * (0.3 if "_conv." in name else 3.0))
    return drafter


def test_block_mask() -> None:
    g, t = 4, 10
    anchors = torch.tensor([[3, 7, 0], [5, 0, 2]])
    valid = torch.tensor([[True, True, False], [True, True, True]])
    mask = block_mask(anchors, valid, t, g)[:, 0]
    assert mask.shape == (2, 3 * g, t + 3 * g)
    for b in range(2):
        for q in range(3 * g):
            blk = q // g
            limit = int(anchors[b, blk]) if valid[b, blk] else 0
            # context: strictly before the anchor (never the anchor itself or later)
            assert mask[b, q, :t].tolist() == [j < limit for j in range(t)]
            # blocks: all rows of its own block (bidirectional), nothing of the others
            assert mask[b, q, t:].tolist() == [j // g == blk for j in range(3 * g)]


def test_anchors_lie_in_the_response() -> None:
    ids = torch.zeros(3, 20, dtype=torch.long)
    batch = Batch(ids, lengths=torch.tensor([20, 12, 6]), prompt_lengths=torch.tensor([5, 10, 5]))
    anchors, valid = sample_anchors(batch, 8, torch.rand(3, 20, generator=torch.Generator().manual_seed(0)))
    assert valid.sum(1).tolist() == [8, 2, 1]  # L - P candidates: 15, 2, 1
    for b in range(3):
        chosen = anchors[b][valid[b]].tolist()
        assert len(set(chosen)) == len(chosen)
        p, n = int(batch.prompt_lengths[b]), int(batch.lengths[b])
        assert all(p - 1 <= a <= n - 2 for a in chosen)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flex_mask_matches_dense() -> None:
    torch.manual_seed(0)
    b, n, g, t, h, hkv, d = 2, 8, 16, 256, 4, 2, 64
    anchors = torch.randint(0, t, (b, n), device="cuda")
    valid = torch.rand(b, n, device="cuda") > 0.2
    q = torch.randn(b, n * g, h, d, device="cuda")
    k, v = (torch.randn(b, n * g, hkv, d, device="cuda") for _ in range(2))
    ctx = tuple(torch.randn(b, t, hkv, d, device="cuda") for _ in range(2))
    dense = DenseAttention({"full_attention": block_mask(anchors, valid, t, g)}).attend(
        q, k, v, ctx, "full_attention", 0.125
    )
    flex = FlexBlockAttention(flex_block_mask(anchors, valid, t, g)).attend(q, k, v, ctx, "full_attention", 0.125)
    torch.testing.assert_close(flex, dense, atol=2e-3, rtol=2e-3)


def test_copy_init_is_the_identity_on_the_deepest_feature(setup, tmp_path) -> None:
    """fc passes the deepest captured layer's stream through, wherever it sits in the id list."""
    _, data, _ = setup
    target_dir = make_target(tmp_path / "t", "qwen3", vocab=VOCAB, layers=4)
    target = load_target(str(target_dir), torch.float32, CPU).model
    h = target.config.hidden_size
    for ids, deepest in (((1, 3), 1), ((3, 1), 0)):
        cfg = config(target_dir, data, tmp_path, init="copy", target_layer_ids=ids)
        drafter, init = build_drafter(target, cfg, VOCAB - 1)
        assert init == "copied from the target"
        expected = torch.zeros(h, len(ids) * h)
        expected[:, deepest * h : (deepest + 1) * h] = torch.eye(h)
        assert torch.equal(drafter.fc.weight, expected)


def test_init_from_a_drafter_directory(setup, tmp_path) -> None:
    """A DSpark drafter starts from a saved DFlash drafter: every backbone tensor its value, the
    heads it lacks random; a source of other target layers or fewer layers is refused by name."""
    target_dir, data, _ = setup
    target = load_target(str(target_dir), torch.float32, CPU)
    source, _ = build_drafter(target.model, config(target_dir, data, tmp_path, layers=2), VOCAB - 1)
    save_drafter(source, target.model, tmp_path / "dflash", dtype=torch.float32)
    cfg = config(target_dir, data, tmp_path, layers=2, method="dspark", init=str(tmp_path / "dflash"))
    drafter, init = build_drafter(target.model, cfg, VOCAB - 1)
    assert isinstance(drafter, DSparkDrafter) and init == f"from {tmp_path / 'dflash'} (4 tensors it lacks random)"
    theirs = dict(source.named_parameters())
    for name, p in drafter.named_parameters():
        if name.startswith(("markov_head.", "confidence_head.")):
            assert name not in theirs
        else:
            assert torch.equal(p, theirs[name]), name
    with pytest.raises(ValueError, match=r"has target-layer-ids \[0\], the new drafter \[-1, 0\]"):
        build_drafter(
            target.model,
            config(target_dir, data, tmp_path, layers=2, init=cfg.init, target_layer_ids=(-1, 0)),
            VOCAB - 1,
        )
    with pytest.raises(ValueError, match=r"dflash lacks layers.2.input_layernorm.weight"):
        build_drafter(
            target.model,
            config(target_dir, data, tmp_path, layers=3, init=cfg.init),
            VOCAB - 1,
        )
    with pytest.raises(ValueError, match="init must be copy, random or a drafter directory, got 'nowhere'"):
        config(target_dir, data, tmp_path, init="nowhere")


def test_target_pass_of_a_sliding_window_target(tmp_path) -> None:
    """Training's frozen-target pass captures what transformers' layers output, sliding layers too,
    and ends in its final hidden states."""
    path = make_target(
        tmp_path / "t", "qwen2", vocab=VOCAB, use_sliding_window=True, sliding_window=6, max_window_layers=2
    )
    target = load_target(str(path), torch.float32, CPU).model
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(0))
    batch = Batch(ids, torch.tensor([20, 15]), torch.tensor([4, 4]))
    hidden, features = target_pass(target, batch, (1, 3))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for row, n in enumerate((20, 15)):
            hs = hf(ids[row : row + 1, :n], output_hidden_states=True).hidden_states
            expected = torch.cat([hs[2][0], hs[4][0]], dim=-1)
            torch.testing.assert_close(features[row, :n], expected, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(hidden[row, :n], hs[-1][0], atol=1e-5, rtol=1e-4)


def test_training_forward_matches_engine_proposal(setup, tmp_path) -> None:
    """A block trained at anchor a predicts exactly what the engine drafts when a is the anchor."""
    target_dir, data, _ = setup
    target = load_target(str(target_dir), torch.float32, CPU)
    drafter, _ = build_drafter(target.model, config(target_dir, data, tmp_path), VOCAB - 1)
    save_drafter(drafter, target.model, tmp_path / "drafter", dtype=torch.float32)
    drafter = load_drafter(tmp_path / "drafter", target.model, torch.float32, CPU)
    spec = {"model": str(tmp_path / "drafter"), "adaptive_width": False}  # every step drafts the full block
    llm = LLM(str(target_dir), spec, device="cpu", dtype="float32")
    for e in read_examples(data)[:3]:
        anchor = len(e.prompt_ids) + 5
        seq = e.prompt_ids + e.response_ids
        out = llm.generate([seq[: anchor + 1]], SamplingParams(temperature=0, max_tokens=8, return_drafts=True))[0]
        with torch.no_grad():
            one = torch.tensor([[anchor]]), torch.tensor([[True]])
            result = dflash_loss(target.model, drafter, collate([e], CPU), *one, row_weights(7, 4.0, CPU))
        assert result.drafts[0, 0].tolist() == out.metrics.draft_token_ids[0]


def test_dspark_loss_matches_a_dense_reference(setup, tmp_path) -> None:
    """Each labelled draft of each block on its own, the target through transformers: row j of the
    block at anchor a (context < a) is labelled with the token at a+j+1, its Markov bias and
    confidence read the token at a+j (teacher forcing, not the draft before it), its target
    distribution is the target's at position a+j, weights exp(-j/4) over the labelled drafts."""
    target_dir, data, _ = setup
    target = load_target(str(target_dir), torch.float32, CPU).model
    drafter = dspark_drafter(target, config(target_dir, data, tmp_path, method="dspark", markov_rank=8, block_size=4))
    examples = read_examples(data)[:2]
    (p0, n0), (p1, n1) = ((len(e.prompt_ids), e.length) for e in examples)
    anchors = torch.tensor([[p0 - 1, n0 - 3, n0 - 2], [p1 + 2, n1 - 2, 0]])  # the last ones: 2 and 1 labels
    valid = torch.tensor([[True, True, True], [True, True, False]])
    with torch.no_grad():
        result = dspark_loss(target, drafter, collate(examples, CPU), anchors, valid, row_weights(4, 4.0, CPU), TERMS)

    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    head, conf = drafter.markov_head, drafter.confidence_head.proj
    loss, weight, drafts, misses = 0.0, 0.0, torch.zeros_like(result.drafts), 0
    with torch.no_grad():
        for b, e in enumerate(examples):
            ids = torch.tensor(e.prompt_ids + e.response_ids)
            out = hf(ids[None], output_hidden_states=True)
            features, p_target = out.hidden_states[1][0], out.logits[0].softmax(-1)  # target layer 0
            for n, a in enumerate(anchors[b].tolist()):
                if not valid[b, n]:
                    continue
                k, v = drafter.context_kv(features[None, :a], torch.arange(a)[None])
                block = torch.tensor([[int(ids[a])] + [VOCAB - 1] * 3])
                attn = DenseAttention({"full_attention": torch.ones(1, 1, 4, a + 4, dtype=torch.bool)})
                h = drafter(target.embed(block), torch.arange(a, a + 4)[None], attn, list(zip(k, v)))[0]
                for j in range(min(4, len(ids) - a - 1)):
                    label, prev = ids[a + j + 1], head.markov_w1.weight[ids[a + j]]
                    logits = target.lm_head.weight @ h[j] + head.markov_w2.weight @ prev
                    l1 = (logits.softmax(-1) - p_target[a + j]).abs().sum()
                    accept = (1 - l1 / 2).clamp(0, 1)
                    c = torch.sigmoid(conf.weight[0] @ torch.cat([h[j], prev]) + conf.bias[0])
                    bce = -(accept * c.log() + (1 - accept) * (1 - c).log())
                    w = math.exp(-j / 4)
                    loss += w * (0.1 * -logits.log_softmax(-1)[label] + 0.9 * l1 + bce)
                    weight += w
                    drafts[b, n, j] = logits.argmax()
                    misses += j > 0 and drafts[b, n, j - 1] != ids[a + j]  # there the draft before differs
    assert misses > 0
    assert torch.equal(result.drafts, drafts)
    torch.testing.assert_close(result.weight, torch.tensor(weight))
    torch.testing.assert_close(result.loss_sum / result.weight, loss / weight, rtol=1e-5, atol=1e-6)


ON_DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")]),
]


@pytest.mark.parametrize("device", ON_DEVICES)
@pytest.mark.parametrize("method", ["dflash", "dspark", "dflash2"])
def test_loss_in_checkpointed_row_chunks_equals_the_whole(setup, tmp_path, monkeypatch, method, device) -> None:
    """Chunks of 5 draft rows, each checkpointed: the same loss, drafts and gradients as all rows at
    once, at a step whose rows are many chunks; on CUDA under the trainer's bf16 autocast."""
    target_dir, data, _ = setup
    device = torch.device(device)  # the trainer's target: fp32 on the CPU, bf16 on CUDA
    target = load_target(str(target_dir), torch.float32 if device.type == "cpu" else torch.bfloat16, device).model
    cfg = config(target_dir, data, tmp_path, method=method, markov_rank=8, block_size=4, selector_rank=8)
    drafters = {"dspark": dspark_drafter, "dflash2": dflash2_drafter}
    drafter = drafters[method](target, cfg) if method in drafters else build_drafter(target, cfg, VOCAB - 1)[0]
    drafter = drafter.to(device)
    batch = collate(read_examples(data)[:4], device)
    anchors, valid = sample_anchors(
        batch, 6, torch.rand(batch.input_ids.shape, generator=torch.Generator().manual_seed(3))
    )
    anchors, valid = anchors.to(device), valid.to(device)
    weights = row_weights(drafter.num_drafts, 4.0, device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step(chunk_elements: int) -> tuple:
        drafter.zero_grad()
        with autocast:
            result = loss(chunk_elements)
        result.loss_sum.sum().backward()  # DFlash2's: its two terms
        grads = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}
        return result.loss_sum.detach(), result.drafts, grads, int(result.total.sum())

    def loss(chunk_elements: int):
        if method == "dspark":
            return dspark_loss(target, drafter, batch, anchors, valid, weights, TERMS, chunk_elements=chunk_elements)
        if method == "dflash2":
            return dflash2_loss(target, drafter, batch, anchors, valid, weights, 1.0, chunk_elements=chunk_elements)
        return dflash_loss(target, drafter, batch, anchors, valid, weights, chunk_elements=chunk_elements)

    calls = []
    monkeypatch.setattr(loss_module, "checkpoint", lambda *a, **k: calls.append(1) or checkpoint(*a, **k))
    whole = step(0)
    assert not calls
    chunked = step(5 * VOCAB)
    assert whole[3] > 20 and len(calls) == -(-whole[3] // 5)  # every labelled row, 5 a chunk
    assert chunked[2].keys() == whole[2].keys() and len(whole[2]) > 4
    if device.type == "cpu":
        torch.testing.assert_close(chunked[0], whole[0], rtol=1e-5, atol=1e-6)
        assert torch.equal(chunked[1], whole[1])
        for name, grad in whole[2].items():
            torch.testing.assert_close(chunked[2][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    else:  # bf16 GEMMs of fewer rows may round differently: a chunk left out moves the loss by a twentieth
        torch.testing.assert_close(chunked[0], whole[0], rtol=5e-3, atol=1e-3)
        assert (chunked[1] == whole[1]).float().mean() > 0.95
        for name, grad in whole[2].items():
            assert F.cosine_similarity(chunked[2][name].flatten(), grad.flatten(), 0) > 0.99, name


def saved_and_served(module, target, target_dir, tmp_path):
    """A drafter module saved, loaded back, and an engine of it at the full width."""
    save_drafter(module, target.model, tmp_path / "drafter", dtype=torch.float32)
    drafter = load_drafter(tmp_path / "drafter", target.model, torch.float32, CPU)
    return drafter, LLM(str(target_dir), {"model": str(tmp_path / "drafter"), "adaptive_width": False}, device="cpu")


def engine_block(llm, e):
    """An example's block 5 tokens into its response as the engine drafts it: its anchor, the
    drafts, and the example continued by them."""
    anchor = len(e.prompt_ids) + 5
    seq = (e.prompt_ids + e.response_ids)[: anchor + 1]
    out = llm.generate([seq], SamplingParams(temperature=0, max_tokens=8, return_drafts=True))[0]
    drafts = out.metrics.draft_token_ids[0]
    return anchor, drafts, Example(0, e.prompt_ids, seq[len(e.prompt_ids) :] + drafts)


@pytest.mark.parametrize("rows,drafts", [("auto", 4), ("filled", 3)])
def test_dspark_training_forward_matches_engine_proposal(setup, tmp_path, rows, drafts) -> None:
    """Given the engine's own drafts as the tokens after the anchor, the teacher-forced argmaxes of
    the block at that anchor are those drafts, all of them: the same rows (shifted, DSpark's own:
    row j drafts anchor+j+1; filled: row j drafts anchor+j), and each bias reads the token before
    its draft."""
    target_dir, data, _ = setup
    target = load_target(str(target_dir), torch.float32, CPU)
    cfg = config(target_dir, data, tmp_path, method="dspark", markov_rank=8, block_size=4, rows=rows)
    drafter, llm = saved_and_served(dspark_drafter(target.model, cfg), target, target_dir, tmp_path)
    assert drafter.shifted == (rows == "auto")
    identity = Trainer(cfg, target.model, drafter, read_examples(data), CPU).identity()
    assert identity.get("shifted", True) == drafter.shifted  # the method's own rows: as checkpoints before the flag
    weights = row_weights(drafts, 4.0, CPU)
    for e in read_examples(data)[:3]:
        anchor, engine_drafts, fed = engine_block(llm, e)
        assert len(engine_drafts) == drafts
        with torch.no_grad():
            one = torch.tensor([[anchor]]), torch.tensor([[True]])
            result = dspark_loss(target.model, drafter, collate([fed], CPU), *one, weights, TERMS)
        assert result.drafts[0, 0].tolist() == engine_drafts


def test_dflash2_starts_as_dflash_ranking_by_the_lm_head(setup, tmp_path) -> None:
    """The random init leaves DFlash2's identity convolutions and zero successor codebook; the
    predecessor codebook is N(0, initializer_range), hidden_projection N(0, 0.02)."""
    target_dir, data, _ = setup
    target = load_target(str(target_dir), torch.float32, CPU).model
    cfg = config(target_dir, data, tmp_path, method="dflash2", selector_rank=64, selector_top_k=8)
    drafter, _ = build_drafter(target, cfg, VOCAB - 1)
    assert isinstance(drafter, DFlash2Drafter) and all(isinstance(x, DFlash2Layer) for x in drafter.layers)
    for conv in (drafter.layers[0].attention_conv, drafter.layers[0].mlp_conv):
        assert conv.base_kernel[:, 0].eq(1).all() and not conv.base_kernel[:, 1:].any()
        assert not conv.kernel_projection.weight.any()
    selector = drafter.candidate_selector
    assert not selector.successor_codebook.any()
    assert selector.predecessor_codebook.std().item() == pytest.approx(0.15, rel=0.05)  # the target's 0.15
    assert selector.hidden_projection.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert drafter.fc.weight.std().item() == pytest.approx(0.15, rel=0.1)


def test_dflash2_loss_matches_a_dense_reference(setup, tmp_path) -> None:
    """Each labelled draft of each block on its own, the target through transformers: draft j (row
    j+1) of the block at anchor a is labelled with the token at a+j+1; its candidates are the top K
    of its LM-head logits, the gold token written into the last slot (its own logit) where it is not
    among them, each scored as unary + sum_r predecessor[p, r] * proj(h)[r] * successor[c, r] with
    p the token at a+j (teacher forcing, not the draft before); the selector's K-way CE is averaged
    over the drafts undecayed, DFlash's CE weighted exp(-j/2). The greedy drafts are the selector's
    best among the unaltered top K against the same predecessor."""
    target_dir, data, _ = setup
    target = load_target(str(target_dir), torch.float32, CPU).model
    k = 4
    cfg = config(target_dir, data, tmp_path, method="dflash2", block_size=4, selector_rank=8, selector_top_k=k)
    drafter = dflash2_drafter(target, cfg)
    examples = read_examples(data)[:2]
    (p0, n0), (p1, n1) = ((len(e.prompt_ids), e.length) for e in examples)
    anchors = torch.tensor([[p0 - 1, p0 + 1, n0 - 3, n0 - 2], [p1 + 2, n1 - 2, p1 + 3, 0]])  # 2, 1 labels at ends
    valid = torch.tensor([[True, True, True, True], [True, True, True, False]])
    with torch.no_grad():
        result = dflash2_loss(target, drafter, collate(examples, CPU), anchors, valid, row_weights(3, 2.0, CPU), 1.0)

    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    selector = drafter.candidate_selector
    pred, succ, proj = selector.predecessor_codebook, selector.successor_codebook, selector.hidden_projection.weight
    ce, weight, sel, wrong = 0.0, 0.0, [], []
    drafts, injected, misses = torch.zeros_like(result.drafts), 0, 0

    def selector_ce(logits, h, candidates, prev, gold) -> torch.Tensor:
        scores = torch.stack([logits[c] + (pred[prev] * (proj @ h) * succ[c]).sum() for c in candidates])
        return -scores.log_softmax(-1)[candidates.index(gold)]

    with torch.no_grad():
        for b, e in enumerate(examples):
            ids = torch.tensor(e.prompt_ids + e.response_ids)
            features = hf(ids[None], output_hidden_states=True).hidden_states[1][0]  # target layer 0
            for n, a in enumerate(anchors[b].tolist()):
                if not valid[b, n]:
                    continue
                kv = drafter.context_kv(features[None, :a], torch.arange(a)[None])
                block = torch.tensor([[int(ids[a])] + [VOCAB - 1] * 3])
                attn = DenseAttention({"full_attention": torch.ones(1, 1, 4, a + 4, dtype=torch.bool)})
                hidden = drafter(target.embed(block), torch.arange(a, a + 4)[None], attn, list(zip(*kv)))[0]
                for j in range(min(3, len(ids) - a - 1)):
                    h, gold, prev = hidden[j + 1], int(ids[a + j + 1]), int(ids[a + j])
                    logits = target.lm_head.weight @ h
                    w = math.exp(-j / 2)
                    ce, weight = ce + w * -logits.log_softmax(-1)[gold], weight + w
                    top = logits.topk(k).indices.tolist()
                    serving = [logits[c] + (pred[prev] * (proj @ h) * succ[c]).sum() for c in top]
                    drafts[b, n, j] = top[int(torch.stack(serving).argmax())]
                    candidates = top if gold in top else top[:-1] + [gold]
                    injected += gold not in top
                    sel.append(selector_ce(logits, h, candidates, prev, gold))
                    own = int(drafts[b, n, j - 1]) if j else prev  # the draft before, as a walk would take
                    misses += own != prev
                    wrong.append(selector_ce(logits, h, candidates, own, gold))
    assert 0 < injected < len(sel) and misses > 0
    assert torch.equal(result.drafts, drafts)
    torch.testing.assert_close(result.weight, torch.tensor([weight, len(sel)]))
    torch.testing.assert_close(result.loss_sum[0] / result.weight[0], ce / weight, rtol=1e-5, atol=1e-6)
    mean, wrong_mean = torch.stack(sel).mean(), torch.stack(wrong).mean()
    torch.testing.assert_close(result.loss_sum[1] / result.weight[1], mean, rtol=1e-5, atol=1e-6)
    assert abs(wrong_mean - mean) > 1e-2 * mean  # the predecessor shows


def test_dflash2_training_forward_matches_engine_proposal(setup, tmp_path) -> None:
    """Given the engine's own drafts as the tokens after the anchor, the training forward's greedy
    drafts of the block at that anchor are those drafts: the same block convolutions (within the
    block) and, teacher-forced on them, the walk's choices among the same candidates."""
    target_dir, data, _ = setup
    target = load_target(str(target_dir), torch.float32, CPU)
    cfg = config(target_dir, data, tmp_path, method="dflash2", block_size=4, selector_rank=8, selector_top_k=4)
    drafter, llm = saved_and_served(dflash2_drafter(target.model, cfg), target, target_dir, tmp_path)
    for e in read_examples(data)[:3]:
        anchor, drafts, fed = engine_block(llm, e)
        assert len(drafts) == 3
        with torch.no_grad():
            # a second block before it: a convolution reaching across blocks would change this one's rows
            two = torch.tensor([[anchor - 4, anchor]]), torch.tensor([[True, True]])
            result = dflash2_loss(target.model, drafter, collate([fed], CPU), *two, row_weights(3, 4.0, CPU), 1.0)
        assert result.drafts[0, 1].tolist() == drafts


def eight_step_config(setup, out: Path, resume: bool = False) -> TrainConfig:
    """A drafter for `setup`'s target: 8 steps, logged every 4, no checkpoint before the end (or a stop)."""
    target_dir, data, _ = setup
    return config(target_dir, data, out, steps=8, log_every=4, save_every=100, resume=resume)


def eight_steps(setup, out: Path, resume: bool = False, mask: int = VOCAB - 1) -> Trainer:
    """`eight_step_config`'s trainer."""
    target_dir, data, _ = setup
    target = load_target(str(target_dir), torch.float32, CPU).model.requires_grad_(False)
    cfg = eight_step_config(setup, out, resume)
    return Trainer(cfg, target, build_drafter(target, cfg, mask)[0], read_examples(data), CPU)


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_resume_is_exact(setup, tmp_path) -> None:
    whole = eight_steps(setup, tmp_path / "a")
    whole.run()
    half = eight_steps(setup, tmp_path / "b")
    half.run(until=4)
    with pytest.raises(CheckpointError, match=f"another run: mask_token_id {VOCAB - 1} -> {VOCAB - 2}"):
        eight_steps(setup, tmp_path / "b", resume=True, mask=VOCAB - 2)  # same shapes, weights that mean other things
    resumed = eight_steps(setup, tmp_path / "b", resume=True)
    assert resumed.step == 4
    resumed.run()
    assert_same_weights(whole.drafter, resumed.drafter)
    logs = [
        [json.loads(x)["loss"] for x in (d / "log.jsonl").read_text().splitlines()]
        for d in (tmp_path / "a", tmp_path / "b")
    ]
    assert logs[0] == logs[1] and len(logs[0]) == 2
    target = whole.target
    fewer = dataclasses.replace(eight_step_config(setup, tmp_path / "a", True), steps=4)  # a checkpoint at step 8
    with pytest.raises(ValueError, match=r"checkpoint is at step 8, past --steps 4"):
        Trainer(fewer, target, build_drafter(target, fewer, VOCAB - 1)[0], read_examples(setup[1]), CPU)


def test_sigterm_stops_at_a_logged_step_with_a_checkpoint_to_resume(setup, tmp_path, monkeypatch) -> None:
    """SIGTERM (a scheduler's or a timeout's stop) during training: the run stops at the next
    logged step, saves a checkpoint of that step, which resumes to the uninterrupted run's weights,
    and leaves the process's own SIGTERM handler as it was."""
    whole = eight_steps(setup, tmp_path / "a")
    whole.run()
    received = []

    def own(signum, frame) -> None:  # not the default handler, which would end the test run
        received.append(signum)

    previous = signal.signal(signal.SIGTERM, own)
    try:
        stopped = eight_steps(setup, tmp_path / "b")
        step = stopped.train_step

        def train_step():
            if stopped.step == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            return step()

        monkeypatch.setattr(stopped, "train_step", train_step)
        with pytest.raises(KeyboardInterrupt, match="SIGTERM at step 4"):
            stopped.run()
        assert stopped.step == 4 and not received  # the run's handler took it
        assert signal.getsignal(signal.SIGTERM) is own
    finally:
        signal.signal(signal.SIGTERM, previous)
    resumed = eight_steps(setup, tmp_path / "b", resume=True)
    assert resumed.step == 4
    resumed.run()
    assert_same_weights(whole.drafter, resumed.drafter)


def test_a_stopped_run_saves_the_drafter_it_has_trained_so_far(setup, tmp_path, monkeypatch) -> None:
    """Ctrl-C (or SIGTERM, which stops as it does) during `train`: the checkpoint and, in the
    published layout, the drafter as of the step it stopped at."""
    step = Trainer.train_step

    def train_step(self):
        if self.step == 5:
            raise KeyboardInterrupt
        return step(self)

    monkeypatch.setattr(Trainer, "train_step", train_step)
    with pytest.raises(KeyboardInterrupt):
        train(eight_step_config(setup, tmp_path))
    mask = json.loads((tmp_path / "drafter" / "config.json").read_text())["dflash_config"]["mask_token_id"]
    checkpoint = eight_steps(setup, tmp_path, resume=True, mask=mask)
    assert checkpoint.step == 5
    assert_same_weights(checkpoint.drafter, load_drafter(tmp_path / "drafter", checkpoint.target, torch.float32, CPU))


def test_resume_refuses_another_drafter_or_a_broken_checkpoint(tmp_path) -> None:
    def drafter(intermediate: int) -> DFlashDrafter:
        geometry = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "block_size": 8}
        cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=intermediate, num_hidden_layers=1,
                          dflash_config={"mask_token_id": 1, "target_layer_ids": [0]}, **geometry)  # fmt: skip
        return DFlashDrafter(cfg, 1, 64)

    saved, identity = drafter(96), {"block_size": 8, "target_layer_ids": [0]}
    save_checkpoint(tmp_path / "ckpt", 3, saved, torch.optim.AdamW(saved.parameters()), {"identity": identity})
    assert load_checkpoint(tmp_path / "ckpt", saved, torch.optim.AdamW(saved.parameters()), identity) == 3
    save_checkpoint(tmp_path / "old", 2, saved, torch.optim.AdamW(saved.parameters()), {})  # before identities
    assert load_checkpoint(tmp_path / "old", saved, torch.optim.AdamW(saved.parameters()), identity) == 2
    other = drafter(128)
    with pytest.raises(CheckpointError, match=r"down_proj.weight has shape \(64, 96\), expected \(64, 128\)"):
        load_checkpoint(tmp_path / "ckpt", other, torch.optim.AdamW(other.parameters()), identity)
    moved = identity | {"target_layer_ids": [1]}  # the same shapes, reading another target layer
    with pytest.raises(CheckpointError, match=r"another run: target_layer_ids \[0\] -> \[1\]"):
        load_checkpoint(tmp_path / "ckpt", saved, torch.optim.AdamW(saved.parameters()), moved)
    (tmp_path / "ckpt" / "state.json").write_text("{truncated")
    with pytest.raises(CheckpointError, match="ckpt: not a complete training checkpoint"):
        load_checkpoint(tmp_path / "ckpt", saved, torch.optim.AdamW(saved.parameters()), identity)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"save_dtype": "bf15"}, "save_dtype: dtype 'bf15' is not supported"),
        ({"log_every": 0}, "save_every and log_every must be >= 1"),
        ({"eval_prompts": -3}, "eval_prompts must be >= 0"),
        ({"method": "eagle"}, "method must be one of dflash, dspark, dflash2, got 'eagle'"),
        ({"method": "dspark", "markov_rank": -1}, "markov_rank must be >= 0"),
        ({"method": "dspark", "markov_head_type": "lstm"}, "markov_head_type must be vanilla/gated/rnn"),
        ({"method": "dspark", "l1_weight": -0.5}, "l1_weight and confidence_weight must be >= 0"),
        ({"method": "dspark", "ce_weight": 0, "l1_weight": 0}, "nothing would train the drafts"),
        ({"method": "dflash2", "conv_kernel_size": 9}, r"conv_kernel_size 9 is wider than the block \(8 rows\)"),
        ({"method": "dflash2", "selector_top_k": 0}, "selector_rank and selector_top_k must be >= 1"),
        ({"method": "dflash2", "selector_weight": -1.0}, "selector_weight must be >= 0"),
        ({"loss_chunk_gib": -1.0}, "loss_chunk_gib must be >= 0, got -1.0"),
        ({"rows": "diagonal"}, "rows must be auto/shifted/filled, got 'diagonal'"),
        ({"method": "dflash2", "rows": "shifted"}, "rows shifted: dflash2 drafters fill their rows"),
        ({"prompt_source": "web"}, "prompt_source must be offline/target, got 'web'"),
        ({"lr": 0.0}, "lr must be > 0, got 0.0"),
        ({"min_lr_ratio": -2.0}, r"min_lr_ratio is a fraction of lr in \[0, 1\], got -2.0"),  # the loss would climb
        ({"weight_decay": -1.0}, "weight_decay must be >= 0"),
        ({"grad_clip": -1.0}, r"grad_clip must be >= 0 \(0: off\)"),
        ({"num_heads": 0}, r"num_heads, num_kv_heads and head_dim must be >= 1 \(or unset: the target's\)"),
    ],
)
def test_bad_training_settings_fail_before_any_work(tmp_path, change, message) -> None:
    with pytest.raises(ValueError, match=message):
        config("t", tmp_path / "data.jsonl", tmp_path / "out", **change)
    assert (
        config("t", tmp_path / "data.jsonl", tmp_path / "out", save_dtype="auto").save_dtype == "auto"
    )  # as run.py reads it


@pytest.mark.parametrize(
    "row, message",
    [
        ('{"prompt": "hi", "response": "there"}', "line 2: not an example of index, prompt_ids and response_ids"),
        ('{"index": 1, "prompt_ids": "12", "response_ids": [3]}', "line 2: index must be an integer, prompt_ids"),
        ('{"index": 1, "prompt_ids": [1, -2], "response_ids": [3]}', "line 2: index must be an integer, prompt_ids"),
        ("{index: 1}", "line 2: not an example"),  # not JSON
        (
            '{"index": 1, "prompt_ids": [1], "response_ids": [5000]}',
            r"token 5000, outside the target's vocabulary \(64",
        ),
        ('{"index": 1, "prompt_ids": [1], "response_ids": []}', "no training example has a response"),
    ],
)
def test_malformed_training_data_is_named(setup, tmp_path, row, message) -> None:
    target, _, _ = setup
    first = '{"index": 0, "prompt_ids": [1, 2], "response_ids": []}'
    data = tmp_path / "data.jsonl"
    data.write_text(f"{first}\n{row}\n")
    with pytest.raises(ValueError, match=message):
        train(config(target, data, tmp_path / "out", eval_prompts=0))


def test_the_loss_chunks_come_from_the_config() -> None:
    """loss_chunk_gib in fp32 elements of each vocabulary-wide tensor, 0 for none (and only 0), to
    every method's loss."""
    weights = torch.ones(3)
    cases = (("dflash", 1.0, 2**28), ("dspark", 0.5, 2**27), ("dspark", 1e-12, 1), ("dflash2", 0.0, 0))
    for method, gib, elements in cases:  # any size above 0 chunks, a row at least
        loss = step_loss(TrainConfig(method=method, loss_chunk_gib=gib), weights, flex=False)
        assert loss.func is {"dflash": dflash_loss, "dspark": dspark_loss, "dflash2": dflash2_loss}[method]
        assert loss.keywords["chunk_elements"] == elements


def test_loss_decay_defaults_to_the_methods_own() -> None:
    assert TrainConfig(block_size=16).loss_gamma == 7  # DFlash's paper: about 3g/8 + 1
    assert TrainConfig(block_size=16, method="dspark").loss_gamma == 4  # DeepSpec's
    assert TrainConfig(method="dspark", gamma=2.5).loss_gamma == 2.5
    assert TrainConfig(block_size=8, method="dflash2").loss_gamma == 4  # DFlash's backbone loss


def test_bad_drafter_settings_name_the_problem(setup, tmp_path) -> None:
    target_dir, data, _ = setup
    target = load_target(str(target_dir), torch.float32, CPU).model
    with pytest.raises(
        ValueError, match=f"training settings: .*mask_token_id {VOCAB} is outside the target vocabulary"
    ):
        build_drafter(target, config(target_dir, data, tmp_path), VOCAB)
    with pytest.raises(ValueError, match="num_attention_heads 3 is not a multiple of num_key_value_heads 2"):
        build_drafter(target, config(target_dir, data, tmp_path, num_heads=3, num_kv_heads=2), VOCAB - 1)
    for change, message in (
        ({"conv_group_size": 24}, "conv_group_size 24 does not divide hidden_size 64"),
        ({"selector_top_k": VOCAB + 1}, f"selector_top_k {VOCAB + 1} is more than the vocabulary"),
    ):
        with pytest.raises(ValueError, match=f"training settings: .*{message}"):
            build_drafter(target, config(target_dir, data, tmp_path, method="dflash2", **change), VOCAB - 1)
    folded = load_target(str(target_dir), torch.float32, CPU, LoadOptions(fold_norms=True))  # as LLM on CUDA
    with pytest.raises(ValueError, match="norm weights are folded"):
        build_drafter(folded.model, config(target_dir, data, tmp_path), VOCAB - 1)
    with pytest.raises(ValueError, match="attention=flex needs CUDA"):  # before any data is generated
        train(config(target_dir, None, tmp_path / "flex", attention="flex"))
    assert not (tmp_path / "flex" / "data.jsonl").exists()
    with pytest.raises(ValueError, match="eval_prompts 512 would hold out all 512 examples"):
        train(config(target_dir, data, tmp_path / "all", eval_prompts=TRAIN))
    (tmp_path / "empty.jsonl").touch()
    with pytest.raises(ValueError, match="no training examples"):
        train(config(target_dir, tmp_path / "empty.jsonl", tmp_path / "none"))


def test_generated_data_is_not_reused_under_other_settings(setup, tmp_path) -> None:
    target_dir, _, _ = setup
    cfg = config(target_dir, None, tmp_path, num_prompts=3, max_new_tokens=4, gen_batch_size=3)
    path = tmp_path / "data.jsonl"
    with pytest.raises(CheckpointError, match="no such model directory"):  # a typo: nothing generated ...
        generate_dataset(dataclasses.replace(cfg, model=str(tmp_path / "typo")), path, CPU)
    assert len(generate_dataset(cfg, path, CPU)) == 3  # ... so the corrected run starts afresh
    assert len(generate_dataset(dataclasses.replace(cfg, num_prompts=5), path, CPU)) == 5  # extended
    changes = [({"temperature": 0.5}, "temperature 0.0 -> 0.5"), ({"max_new_tokens": 6}, "max_new_tokens 4 -> 6")]
    changes += [({"model": "other"}, f"model {cfg.model!r} -> 'other'")]
    for change, differ in changes:
        with pytest.raises(ValueError, match=re.escape(f"other settings ({differ})")):
            generate_dataset(dataclasses.replace(cfg, **change), path, CPU)
    part = path.rename(path.with_name("data.rank0-of-2.jsonl"))  # all an interrupted 2-rank run left
    with pytest.raises(ValueError, match=re.escape("other settings (temperature 0.0 -> 0.5)")):
        generate_dataset(dataclasses.replace(cfg, temperature=0.5), path, CPU)
    part.rename(path)
    path.with_suffix(".settings.json").unlink()
    with pytest.raises(ValueError, match="has no record of its settings"):
        generate_dataset(cfg, path, CPU)


def test_training_raises_acceptance_length(setup, tmp_path) -> None:
    target_dir, data, held_out = setup
    cfg = config(target_dir, data, tmp_path / "out")
    target = load_target(str(target_dir), torch.float32, CPU)
    untrained, _ = build_drafter(target.model, cfg, VOCAB - 1)  # the same start as the run below
    save_drafter(untrained, target.model, tmp_path / "untrained", dtype=torch.float32)
    before = acceptance_lengths(str(target_dir), tmp_path / "untrained", held_out, NEW_TOKENS, CPU)

    trained = train(cfg)
    assert sorted(p.name for p in trained.iterdir()) == ["config.json", "model.safetensors"]
    after = acceptance_lengths(str(target_dir), trained, held_out, NEW_TOKENS, CPU)
    tau_before, tau_after = sum(before) / len(before), sum(after) / len(after)
    print(f"tau untrained {tau_before:.3f}, trained {tau_after:.3f}")  # measured: 1.03, 2.43
    assert tau_before < 1.3
    assert tau_after > 1.8 and tau_after > 1.6 * tau_before, (tau_before, tau_after)


def test_dspark_training_lowers_its_loss_and_the_engine_runs_its_drafter(setup, tmp_path) -> None:
    target_dir, data, held_out = setup
    cfg = config(target_dir, data, tmp_path / "out", method="dspark", markov_rank=16, steps=60, log_every=10)
    path = train(cfg)
    losses = [json.loads(x)["loss"] for x in (tmp_path / "out" / "log.jsonl").read_text().splitlines()]
    assert len(losses) == 6 and losses == sorted(losses, reverse=True) and losses[-1] < 0.8 * losses[0], losses
    saved = json.loads((path / "config.json").read_text())
    assert saved["architectures"] == ["Qwen3DSparkModel"] and saved["block_size"] == 8
    assert (saved["markov_rank"], saved["enable_confidence_head"], saved["confidence_head_with_markov"]) == (
        16,
        True,
        True,
    )
    target = load_target(str(target_dir), torch.float32, CPU).model
    drafter = load_drafter(path, target, torch.float32, CPU)
    assert isinstance(drafter, DSparkDrafter) and drafter.num_drafts == 8 and drafter.confidence_head is not None
    assert_decodes_as_plain(target_dir, path, held_out[:8])


def assert_decodes_as_plain(target_dir, drafter_dir, prompts) -> None:
    """Greedy speculative output equals plain decoding's, and the drafter's drafts get accepted."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    full_width = {"model": str(drafter_dir), "adaptive_width": False}  # adaptive widths follow step timings
    outputs = [LLM(str(target_dir), spec, device="cpu").generate(prompts, params) for spec in (None, full_width)]
    plain, speculative = ([o.outputs[0].token_ids for o in out] for out in outputs)
    assert speculative == plain
    taus = [n for o in outputs[1] for n in o.metrics.acceptance_lengths]
    assert sum(taus) / len(taus) > 1.2  # it drafts something the target accepts


def test_dflash2_training_lowers_its_loss_and_the_engine_runs_its_drafter(setup, tmp_path) -> None:
    target_dir, data, held_out = setup
    out = tmp_path / "out"
    args = ["train", "--model", str(target_dir), "--output", str(out), "--device", "cpu", "--data", str(data)]
    args += ["--layers", "1", "--block-size", "8", "--steps", "60", "--batch-size", "16", "--blocks-per-seq", "16"]
    args += ["--lr", "3e-3", "--log-every", "10", "--save-dtype", "float32", "--method", "dflash2"]
    cli_main(args + ["--selector-rank", "16", "--selector-top-k", "8"])
    losses = [json.loads(x)["loss"] for x in (out / "log.jsonl").read_text().splitlines()]
    assert len(losses) == 6 and losses == sorted(losses, reverse=True) and losses[-1] < 0.8 * losses[0], losses
    path = out / "drafter"
    saved = json.loads((path / "config.json").read_text())
    assert saved["architectures"] == ["DFlash2DraftModel"] and saved["block_size"] == 8
    fields = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    assert [saved["dflash_config"][f] for f in fields] == [2, 16, 16, 8]
    target = load_target(str(target_dir), torch.float32, CPU).model
    drafter = load_drafter(path, target, torch.float32, CPU)
    assert isinstance(drafter, DFlash2Drafter) and drafter.candidate_selector.top_k == 8
    assert drafter.candidate_selector.successor_codebook.any()  # the selector trained
    assert_decodes_as_plain(target_dir, path, held_out[:8])


def test_cli_generates_trains_and_resumes(tmp_path, capsys) -> None:
    target = make_target(tmp_path / "target", "llama", vocab=VOCAB, layers=2)
    out = tmp_path / "out"
    args = ["train", "--model", str(target), "--output", str(out), "--device", "cpu", "--layers", "1"]
    args += ["--block-size", "4", "--max-new-tokens", "12", "--batch-size", "4", "--eval-prompts", "2"]
    cli_main(args + ["--num-prompts", "10", "--steps", "3"])
    first = read_examples(out / "data.jsonl")
    config = json.loads((out / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 4
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == 3

    cli_main(args + ["--num-prompts", "14", "--steps", "5", "--resume"])  # more data, more steps
    again = read_examples(out / "data.jsonl")
    indices = [e.index for e in again]
    assert again[: len(first)] == first and len(again) > len(first)
    assert indices == sorted(set(indices)) and indices[-1] <= 13
    assert all(e.index >= 10 for e in again[len(first) :])  # continued where it stopped, nothing redone
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == 5
    with pytest.raises(SystemExit):  # without --resume a run into it would replace the run it holds
        cli_main(args + ["--num-prompts", "10", "--steps", "2"])
    assert "holds an earlier run" in capsys.readouterr().err
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == 5
    with pytest.raises(SystemExit):
        cli_main(args[:4] + [str(out / "data.jsonl")] + args[5:] + ["--steps", "2"])  # a file as the output
    assert "data.jsonl is a file, not a directory" in capsys.readouterr().err


def train_as_rank(rank: int, size: int, port: int, cfg: TrainConfig) -> None:
    """What `torchrun --nproc-per-node SIZE` gives each process: its place in the environment."""
    torch.set_num_threads(1)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(size), "GLOO_SOCKET_IFNAME": "lo"}
    os.environ.update(env | {"RANK": str(rank), "LOCAL_RANK": str(rank)})
    train(cfg)


def test_two_ranks_generate_and_train_as_one(tmp_path) -> None:
    """Two data-parallel ranks (gloo on CPU) produce the single process's data file and, after
    several optimizer steps over batches they split, its weights."""
    target = make_target(tmp_path / "target", "llama", vocab=VOCAB, layers=2)
    base = {"model": str(target), "device": "cpu", "layers": 1, "block_size": 4, "max_new_tokens": 12}
    base |= {"num_prompts": 10, "steps": 4, "batch_size": 4, "blocks_per_seq": 4, "save_dtype": "float32"}
    train(TrainConfig(output=str(tmp_path / "one"), **base))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(train_as_rank, (2, port, TrainConfig(output=str(tmp_path / "two"), **base)), nprocs=2)

    one, two = (read_examples(tmp_path / d / "data.jsonl") for d in ("one", "two"))
    assert [e.index for e in one] == list(range(10)) and one == two
    assert not list((tmp_path / "two").glob("data.rank*"))  # the parts were merged and removed
    weights = [load_file(tmp_path / d / "checkpoint" / "model.safetensors") for d in ("one", "two")]
    start = build_drafter(load_target(str(target), torch.float32, CPU).model, TrainConfig(**base), VOCAB - 1)[0]
    moved = [n for n, p in start.named_parameters() if not torch.equal(p, weights[0][n])]
    assert len(moved) > 5  # the steps trained something
    for name in weights[0]:
        # Adam moves each weight about lr (6e-4) a step: unsynchronised ranks differ by that much
        torch.testing.assert_close(weights[1][name], weights[0][name], rtol=0, atol=2e-5, msg=name)
    logs = [[json.loads(x) for x in (tmp_path / d / "log.jsonl").read_text().splitlines()] for d in ("one", "two")]
    for one_line, two_line in zip(*logs, strict=True):  # the metrics summed over ranks: the whole batch's
        for key in ("loss", "tau_est"):
            assert two_line[key] == pytest.approx(one_line[key], rel=1e-4), key
        assert two_line["acc"] == pytest.approx(one_line["acc"], abs=1e-4)


def gradients_as_rank(rank: int, size: int, port: int, cfg: TrainConfig, out: Path) -> None:
    """One training step on rank `rank` of `size`; rank 0 saves the drafter's gradients."""
    torch.set_num_threads(1)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(size), "GLOO_SOCKET_IFNAME": "lo"}
    os.environ.update(env | {"RANK": str(rank), "LOCAL_RANK": str(rank)})
    world, device = init_world(CPU)
    try:
        target = load_target(cfg.model, torch.float32, device).model.requires_grad_(False)
        trainer = Trainer(cfg, target, build_drafter(target, cfg, VOCAB - 1)[0], read_examples(cfg.data), device, world)
        trainer.train_step()
        if world.main:
            save_file({n: p.grad for n, p in trainer.drafter.named_parameters()}, out)
    finally:
        close_world(world)


def test_data_parallel_gradients_are_the_single_process_ones(setup, tmp_path) -> None:
    """Two DDP ranks (gloo on CPU), each on half of a step's batch, reach the gradient of the
    single process over the whole batch (not the mean of the halves' own losses)."""
    target_dir, data, _ = setup
    cfg = config(target_dir, data, tmp_path, method="dspark", markov_rank=8, batch_size=6, grad_clip=0.0)
    gradients_as_rank(0, 1, 0, cfg, tmp_path / "one.safetensors")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # forked: spawned ranks would import this module again, ~10 s on the CI machine
    torch.multiprocessing.start_processes(
        gradients_as_rank, (2, port, cfg, tmp_path / "two.safetensors"), nprocs=2, start_method="fork"
    )
    one, two = (load_file(tmp_path / f"{n}.safetensors") for n in ("one", "two"))
    assert one.keys() == two.keys() and any("markov_head" in n for n in one)
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-4, atol=1e-7, msg=name)


def test_merging_parts_keeps_each_prompt_once(tmp_path) -> None:
    """Rank parts (this run's, or an interrupted run's with another number of ranks) are appended
    in prompt order, prompts already merged are not added twice, and the parts go."""
    path = tmp_path / "data.jsonl"
    append_examples(path, [Example(i, [1], [2, 3]) for i in (0, 1)])
    append_examples(tmp_path / "data.rank0-of-2.jsonl", [Example(i, [1], [2, 3]) for i in (2, 4)])
    append_examples(tmp_path / "data.rank1-of-2.jsonl", [Example(i, [1], [2, 3]) for i in (1, 3)])
    merge_parts(path, sorted(tmp_path.glob("data.rank*")))
    assert [e.index for e in read_examples(path)] == [0, 1, 2, 3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.jsonl"]


def test_prompts_come_from_offline_text() -> None:
    prompts = build_prompts(40, seed=0)
    assert len(prompts) == 40 and len(set(prompts)) == 40
    assert all(isinstance(p, str) and len(p) > 20 for p in prompts)
    assert build_prompts(40, seed=0) == prompts != build_prompts(40, seed=1)  # deterministic per seed
    assert build_prompts(400, seed=0)[:40] == prompts  # more prompts extend the list: none is asked twice
    assert build_prompts(400, seed=0)[:5] == build_prompts(5, seed=0)  # also where a tenth rounds to 0


def test_the_target_writes_its_own_user_requests(tmp_path) -> None:
    """Magpie: the template up to a user's message (w3 in the test template, whose user turn ends at
    w4), sampled on: requests ended by the turn's end, distinct, long enough, reproducible for a
    seed; draws cut off by max_tokens (or too short) are dropped, and too few usable is an error.
    `blockspec train --write-prompts --prompt-source target` writes them."""
    target = add_word_tokenizer(make_target(tmp_path / "t", "qwen3"), 128)
    llm = LLM(str(target), None, "cpu", "float32", max_num_seqs=16, warm_up=False)
    turn = user_turn(llm)
    assert (turn.prefix, turn.end) == ([3], 4)
    prompts = target_prompts(llm, 6, seed=0, max_tokens=64)
    assert len(set(prompts)) == 6 and all(len(p) >= MIN_CHARS for p in prompts)
    words = [w for p in prompts for w in p.split()]
    assert all(w.startswith("w") for w in words) and "w4" not in words
    assert target_prompts(llm, 6, seed=0, max_tokens=64) == prompts != target_prompts(llm, 6, seed=1, max_tokens=64)
    assert all(len(p.split()) < 8 for p in target_prompts(llm, 2, seed=0, max_tokens=8))  # none cut off
    with pytest.raises(ValueError, match="usable prompts of 3"):
        target_prompts(llm, 3, seed=0, max_tokens=1)  # one token: cut off, or the turn's end alone
    out = tmp_path / "prompts.jsonl"
    train(TrainConfig(model=str(target), device="cpu", write_prompts=str(out), prompt_source="target", num_prompts=4))
    assert len(set(read_prompts(out))) == 4
    untemplated = make_target(tmp_path / "u", "qwen3")
    with pytest.raises(ValueError, match="needs a target with a chat template"):
        user_turn(LLM(str(untemplated), None, "cpu", "float32", warm_up=False))


def test_the_targets_requests_are_kept_only_ended_long_enough_and_once(tmp_path) -> None:
    """Each check on a draw is what keeps it out: scripted draws (text, finish reason) in the order
    drawn give exactly the requests ended by the turn's end, of MIN_CHARS or more, each once;
    the prefix every draw starts from is the template's user turn."""
    target = add_word_tokenizer(make_target(tmp_path / "t", "qwen3"), 128)
    llm = LLM(str(target), None, "cpu", "float32", warm_up=False)
    script = [
        (" w10 w11 w12 w13 ", "stop"),
        ("w20 w21 w22 w23", "length"),  # cut off
        ("w10 w11 w12 w13", "stop"),  # drawn before
        ("w30 w3", "stop"),  # under MIN_CHARS
        ("w40 w41 w42 w43", "stop"),
    ]
    starts = []

    def generate(prompts, params):
        starts.extend(prompts)
        drawn = [script.pop(0) if script else ("w50 w51 w52 w53", "stop") for _ in prompts]
        return [
            RequestOutput("r", None, p, [CompletionOutput(0, t, [], f)], True, RequestMetrics())
            for p, (t, f) in zip(prompts, drawn)
        ]

    scripted = SimpleNamespace(tokenizer=llm.tokenizer, generate=generate)
    assert target_prompts(scripted, 3, seed=0) == ["w10 w11 w12 w13", "w40 w41 w42 w43", "w50 w51 w52 w53"]
    assert starts and all(p == [3] for p in starts)


def test_word_problems_stay_within_a_tenth(monkeypatch) -> None:
    monkeypatch.setattr(prompts_module, "from_files", lambda *args: iter(()))  # every other source dry
    assert len(build_prompts(50, seed=0)) == 1  # the first; a second would pass a tenth of two
