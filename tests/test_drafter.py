"""The drafter's paged block forward against a dense implementation written here from the
DFlash definition: context K/V from hidden_norm(fc(features)), block rows bidirectional."""

import math

import pytest
import torch
from conftest import make_drafter, make_target
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Qwen3Config

from blockspec.engine.kv_cache import allocate_kv_cache
from blockspec.engine.kv_cache_manager import KVCacheManager
from blockspec.engine.runner import ModelRunner
from blockspec.engine.sequence import Sequence
from blockspec.loading.drafters import load_drafter, save_drafter
from blockspec.loading.hf import load_target
from blockspec.models.dflash import DFlashDrafter, default_target_layer_ids
from blockspec.proposers.dflash import DFlashProposer
from blockspec.sampling import SamplingParams

EPS = 1e-6


def rms(x, w):
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


def rope(x, pos, dim=16, theta=10000.0):
    inv = 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)
    ang = pos[:, None].float() * inv
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    return x * cos + torch.cat([-x[..., dim // 2 :], x[..., : dim // 2]], -1) * sin


def dense_conv(w, prefix, side, normed, x):
    """DFlash2's convolution `prefix` (its base_kernel [2, taps, H] and kernel_projection), on
    `side` (0: input, 1: output), of x [g, H] over the block's rows: out[i, c] = sum_t (base[side,
    t, c] + delta[i, side, t, c // group]) x[i - t, c], delta projected from the normed input."""
    base, proj = w[f"{prefix}.base_kernel"], w[f"{prefix}.kernel_projection.weight"]
    taps, h = base.shape[1:]
    group = h // (proj.shape[0] // (2 * taps))
    delta = (normed @ proj.T).view(len(x), 2, taps, -1)
    out = torch.zeros_like(x)
    for i in range(len(x)):
        for t in range(min(taps, i + 1)):
            out[i] += (base[side, t] + delta[i, side, t].repeat_interleave(group)) * x[i - t]
    return out


def dense_block_hidden(w, layers, feats, anchor_emb_block, p, window=None, masks=None):
    """The normed hidden states [g, H] of every block row. feats: [p, F] context features; block:
    [g, H] embeddings of [anchor, MASK...]; the block sees the last `window` context positions, or
    each layer i the keys masks[i] [g, p + g] allows (context, then block). Where the layer has
    DFlash2's convolutions (in `w`), each sublayer reads the input side of its normed input and
    adds the output side of its output (never the context's K/V)."""
    g = anchor_emb_block.shape[0]
    c = rms(feats @ w["fc.weight"].T, w["hidden_norm.weight"])
    ctx_pos, blk_pos = torch.arange(p), torch.arange(p, p + g)
    keep = ctx_pos >= p - window if window else torch.ones(p, dtype=torch.bool)
    if masks is not None:
        keep = torch.ones(p, dtype=torch.bool)
    x = anchor_emb_block
    for i in range(layers):

        def L(name: str, i: int = i) -> torch.Tensor:
            return w[f"layers.{i}.{name}"]

        conv = f"layers.{i}.attention_conv.base_kernel" in w
        normed = h = rms(x, L("input_layernorm.weight"))
        if conv:
            h = dense_conv(w, f"layers.{i}.attention_conv", 0, normed, normed)
        q = rms((h @ L("self_attn.q_proj.weight").T).view(g, 4, 16), L("self_attn.q_norm.weight"))
        kb = rms((h @ L("self_attn.k_proj.weight").T).view(g, 2, 16), L("self_attn.k_norm.weight"))
        kc = rms((c @ L("self_attn.k_proj.weight").T).view(p, 2, 16), L("self_attn.k_norm.weight"))
        vb = (h @ L("self_attn.v_proj.weight").T).view(g, 2, 16)
        vc = (c @ L("self_attn.v_proj.weight").T).view(p, 2, 16)
        k = torch.cat([rope(kc, ctx_pos)[keep], rope(kb, blk_pos)])
        v = torch.cat([vc[keep], vb])
        q = rope(q, blk_pos)
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)  # GQA 4 q heads / 2 kv heads
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(16)
        if masks is not None:
            scores = scores.masked_fill(~masks[i], float("-inf"))
        att = torch.softmax(scores, dim=-1)
        o = torch.einsum("hqk,khd->qhd", att, v).reshape(g, 64)
        o = o @ L("self_attn.o_proj.weight").T
        x = x + (dense_conv(w, f"layers.{i}.attention_conv", 1, normed, o) if conv else o)
        normed = h = rms(x, L("post_attention_layernorm.weight"))
        if conv:
            h = dense_conv(w, f"layers.{i}.mlp_conv", 0, normed, normed)
        gate, up = h @ L("mlp.gate_proj.weight").T, h @ L("mlp.up_proj.weight").T
        m = (torch.nn.functional.silu(gate) * up) @ L("mlp.down_proj.weight").T
        x = x + (dense_conv(w, f"layers.{i}.mlp_conv", 1, normed, m) if conv else m)
    return rms(x, w["norm.weight"])


@pytest.mark.parametrize("window,layer_ids", [(None, [1, 3, 4]), (5, [1, 3, 4]), (None, [2, 4, 5]), (None, [-1, 2, 4])])
def test_block_forward_matches_dense_reference(tmp_path, window, layer_ids):
    """layer_ids with the last layer (5): HF's hidden_states[6] is after the final norm; with -1:
    hidden_states[0], the embedding output."""
    tpath = make_target(tmp_path / "t", "qwen3", layers=6)
    dpath = make_drafter(tmp_path / "d", tpath, layers=2, block_size=6, target_layer_ids=layer_ids)
    target = load_target(tpath, torch.float32, torch.device("cpu")).model
    drafter = load_drafter(dpath, target, torch.float32, torch.device("cpu"))
    hf = AutoModelForCausalLM.from_pretrained(tpath, dtype=torch.float32)
    w = load_file(dpath / "model.safetensors")
    page = 4
    tc = allocate_kv_cache(6, 32, page, 2, 16, torch.float32, "cpu")
    dc = allocate_kv_cache(2, 32, page, 2, 16, torch.float32, "cpu")
    proposer = DFlashProposer(drafter, window)
    runner = ModelRunner(target, proposer, tc, dc, page)
    pages = KVCacheManager((None,), [32], page, False)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 127, (n,), generator=gen).tolist() for n in (13, 6)]
    widths = [4, 2]  # different context lengths and widths in one batch, both narrower than the block
    # Each is drafted as the whole block (6 rows, as trained), cut to its first drafts.
    seqs = [Sequence(None, p, SamplingParams(), 0) for p in prompts]
    for s, g in zip(seqs, widths):
        pages.allocate(s, len(s.token_ids) + drafter.block_size)
    runner.prefill(seqs)
    with torch.inference_mode():
        logits = drafter.compute_logits(
            proposer.draft_hidden(runner, runner.step_inputs(seqs, widths, None, None)), target
        )
    for i, (ids, g) in enumerate(zip(prompts, widths)):
        with torch.no_grad():
            hs = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
            feats = torch.cat([hs[j + 1][0, :-1] for j in layer_ids], dim=-1)  # context: all but the anchor
            block = torch.tensor([ids[-1]] + [drafter.mask_token_id] * (drafter.block_size - 1))
            hidden = dense_block_hidden(w, 2, feats, hf.model.embed_tokens(block), len(ids) - 1, window)
            expected = hidden[1:] @ hf.lm_head.weight.T
        torch.testing.assert_close(logits[i, : g - 1], expected[: g - 1], atol=1e-4, rtol=1e-4)


def reference_mask(kind: str, causal: bool | None, p: int, g: int, window: int) -> torch.Tensor:
    """[g, p + g]: which keys (context 0..p-1, then the block p..p+g-1) a block row at position
    p + i sees, as z-lab's reference (07ebd93) masks them: causal layers (all with is_causal true;
    with it unset, the sliding ones) see no key after the row; a sliding layer's row q sees keys
    k with q - window < k (and k < q + window)."""
    q, k = torch.arange(p, p + g)[:, None], torch.arange(p + g)[None, :]
    is_causal = causal if causal is not None else kind == "sliding_attention"
    mask = k <= q if is_causal else torch.ones(g, p + g, dtype=torch.bool)
    if kind == "sliding_attention":
        mask = mask & (q - window < k) & (k < q + window)
    return mask


@pytest.mark.parametrize("causal", [None, True, False])
def test_layer_kinds_attend_as_the_reference_masks(tmp_path, causal):
    """A sliding and a full layer, a window of 5, contexts shorter and longer than the window."""
    kinds, window = ["sliding_attention", "full_attention"], 5
    extra = {"layer_types": kinds, "use_sliding_window": True, "sliding_window": window}
    extra |= {"is_causal": causal} if causal is not None else {}
    tpath = make_target(tmp_path / "t", "qwen3", layers=4)
    dpath = make_drafter(tmp_path / "d", tpath, block_size=6, target_layer_ids=[1, 3], **extra)
    target = load_target(tpath, torch.float32, torch.device("cpu")).model
    drafter = load_drafter(dpath, target, torch.float32, torch.device("cpu"))
    assert drafter.is_causal == causal
    hf = AutoModelForCausalLM.from_pretrained(tpath, dtype=torch.float32)
    w, page = load_file(dpath / "model.safetensors"), 4
    proposer = DFlashProposer(drafter)
    runner = ModelRunner(
        target,
        proposer,
        allocate_kv_cache(4, 32, page, 2, 16, torch.float32, "cpu"),
        allocate_kv_cache(2, 32, page, 2, 16, torch.float32, "cpu"),
        page,
    )
    pages = KVCacheManager((None,), [32], page, False)
    prompts = [[(i * 37) % 120 + 1 for i in range(n)] for n in (4, 14)]  # 3 and 13 context positions
    seqs = [Sequence(None, p, SamplingParams(), 0) for p in prompts]
    for s in seqs:
        pages.allocate(s, len(s.token_ids) + 6)
    runner.prefill(seqs)
    with torch.inference_mode():
        hidden = proposer.draft_hidden(runner, runner.step_inputs(seqs, [6, 6], None, None))
    for i, ids in enumerate(prompts):
        p = len(ids) - 1
        with torch.no_grad():
            hs = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
            feats = torch.cat([hs[j + 1][0, :-1] for j in (1, 3)], dim=-1)
            block = torch.tensor([ids[-1]] + [drafter.mask_token_id] * 5)
            masks = [reference_mask(kind, causal, p, 6, window) for kind in kinds]
            expected = dense_block_hidden(w, 2, feats, hf.model.embed_tokens(block), p, masks=masks)
        torch.testing.assert_close(hidden[i], expected[1:], atol=1e-4, rtol=1e-4)


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(30, 1) == [15]
    assert default_target_layer_ids(4, 2) == [1]  # a tiny target: distinct ids in range
    assert default_target_layer_ids(1, 2) == [0]


def test_save_and_load_keep_every_field(tmp_path):
    """save_drafter writes every field the drafter reads: sliding layers and their window, the
    embedding and logit scales, the softcap (not only what training sets)."""
    tpath = make_target(tmp_path / "t", "qwen3")
    target = load_target(tpath, torch.float32, torch.device("cpu")).model
    config = Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, use_sliding_window=True, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], block_size=8,
        dflash_config={"mask_token_id": 127, "target_layer_ids": [1, 3], "input_embedding_scale": 2.0,
                       "output_multiplier": 0.5, "final_logit_softcapping": 30.0},
    )  # fmt: skip
    saved = DFlashDrafter(config, 4, 64)
    save_drafter(saved, target, tmp_path / "d", dtype=torch.float32)
    loaded = load_drafter(tmp_path / "d", target, torch.float32, torch.device("cpu"))
    fields = ("layer_types", "sliding_window", "block_size", "mask_token_id", "target_layer_ids")
    fields += ("input_embedding_scale", "output_multiplier", "logit_softcap")
    assert [getattr(loaded, f) for f in fields] == [getattr(saved, f) for f in fields]
    assert loaded.sliding_window == 4 and loaded.logit_softcap == 30.0
    for (name, a), b in zip(saved.named_parameters(), loaded.parameters()):
        assert torch.equal(a, b), name
