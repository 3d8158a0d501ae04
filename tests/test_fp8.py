"""FP8 (E4M3, per-row scales): quantization error bounds, the reference Fp8Linear (W8A8),
and swapping a drafter's linears (greedy output stays the target's). The Triton kernel behind
Fp8Linear on CUDA is tested in test_kernels_linear.py and test_kernels_quantize.py."""

import fnmatch
import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config

from blockspec import LLM, SamplingParams
from blockspec.layers import quantization
from blockspec.layers.linear import Linear, dense
from blockspec.layers.norm import RMSNorm
from blockspec.layers.quantization import FP8_DTYPE, Fp8Linear, dequantize_weight, quantize_weight
from blockspec.loading import fp8 as fp8_loading
from blockspec.loading.drafters import save_drafter
from blockspec.loading.fp8 import DRAFTER_FP8_PATTERNS, quantize_drafter, quantize_linears, resolve_fp8
from blockspec.models.dflash import DFlashDrafter

CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
DEVICE = torch.device("cuda" if CUDA else "cpu")
REL_STEP = 2.0**-4  # E4M3: 3 mantissa bits, so round-to-nearest errs by <= 2^-4 of the value
SUBNORMAL_HALF_STEP = 2.0**-10  # below 2^-6 the spacing is 2^-9 (in units of the row scale)


def random_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Rows of very different magnitudes, an outlier row, a row reaching subnormals, a zero row."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.logspace(-4, 2, n)[torch.randperm(n, generator=gen)][:, None]
    w[0, 3] = 1e3 * w[0].abs().max()  # one huge value: the rest of the row falls to subnormals
    w[1] = 0.0
    return w


# -- quantization math (pure torch) -------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantization_error_bounds(dtype):
    w = random_weight(64, 300).to(dtype)
    q, scale = quantize_weight(w)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (64,)
    deq = dequantize_weight(q, scale, torch.float32)
    w32 = w.float()
    assert torch.isfinite(deq).all()
    # every element: half a step at its exponent, or half a subnormal step of the row
    bound = torch.maximum(REL_STEP * w32.abs(), SUBNORMAL_HALF_STEP * scale[:, None])
    assert ((deq - w32).abs() <= bound * (1 + 1e-5)).all()
    # every row: relative error (Frobenius) within the E4M3 step, and its max is exact
    nonzero = w32.abs().amax(1) > 0
    rel = (deq - w32).norm(dim=1) / w32.norm(dim=1).clamp_min(1e-30)
    assert (rel[nonzero] <= REL_STEP).all(), rel.max()
    rows = torch.arange(64)
    arg = w32.abs().argmax(1)
    torch.testing.assert_close(deq[rows, arg], w32[rows, arg], rtol=1e-6, atol=0)
    assert q.float().abs().amax(1)[nonzero].eq(448.0).all()
    # the zero row: scale 1, q 0
    assert scale[1] == 1.0 and q[1].float().eq(0).all()
    # typical (Gaussian) rows do far better than the bound
    assert rel[2:].median() < REL_STEP / 2


def test_quantization_in_chunks_equals_whole(monkeypatch):
    w = random_weight(50, 70, seed=1)
    q, s = quantize_weight(w)
    monkeypatch.setattr(quantization, "_CHUNK_ELEMENTS", 7 * 70)
    q2, s2 = quantize_weight(w)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
    assert torch.equal(dequantize_weight(q, s, torch.bfloat16), (q.float() * s[:, None]).to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_reference_path_is_w8a8_f_linear(dtype, bias):
    """W8A8 at every row count: each row of the prologue's output is rounded to E4M3 with its own
    scale, as a weight row is, then the GEMM (`dense`: F.linear, or addmm with the residual) with
    the dequantized weight."""
    torch.manual_seed(0)
    linear = nn.Linear(96, 40, bias=bias).to(dtype)
    layer = Fp8Linear.from_linear(linear)
    norm = RMSNorm(96, 1e-6).to(dtype)
    norm.weight.data.uniform_(0.5, 2.0)
    deq_w = (layer.weight.float() * layer.weight_scale[:, None]).to(dtype)
    for rows in (2, 16, 17, 40):
        x = random_weight(rows, 96, seed=rows).to(dtype)  # rows of very different magnitudes, a zero row
        residual = torch.randn(rows, 40, dtype=dtype)
        h = dequantize_weight(*quantize_weight(norm(x)), dtype)
        assert torch.equal(layer(x, norm=norm, residual=residual), dense(h, deq_w, linear.bias, residual))
        assert torch.equal(
            layer(x.view(1, rows, 96)),
            F.linear(dequantize_weight(*quantize_weight(x), dtype), deq_w, linear.bias).view(1, rows, 40),
        )
        # and close to the unquantized layer: weight and activation rounding add up
        y = (residual + linear(norm(x))).float()
        err = (layer(x, norm=norm, residual=residual).float() - y).norm() / y.norm()
        assert err < REL_STEP, (rows, err)


def test_dtype_casts_keep_fp8_storage():
    layer = Fp8Linear.from_linear(nn.Linear(32, 16))
    q, s = layer.weight.clone(), layer.weight_scale.clone()
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.float(), lambda m: m.to("cpu")):
        cast(layer)
        assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale.dtype == torch.float32
        assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(layer.weight_scale, s)
    layer.to(torch.bfloat16)
    assert layer.bias.dtype == torch.bfloat16 and not layer.bias.requires_grad
    assert layer(torch.randn(2, 32, dtype=torch.bfloat16)).dtype == torch.bfloat16
    assert set(layer.state_dict()) == {"weight", "weight_scale", "bias"}
    assert "fp8" in repr(layer)


def test_concat_equals_quantizing_the_stacked_weight():
    torch.manual_seed(0)
    parts = [nn.Linear(48, n) for n in (16, 8, 24)]
    fused = Fp8Linear.concat([parts[0], Fp8Linear.from_linear(parts[1]), parts[2]])
    whole = Fp8Linear.from_weight(torch.cat([p.weight for p in parts]), torch.cat([p.bias for p in parts]))
    assert torch.equal(fused.weight.view(torch.uint8), whole.weight.view(torch.uint8))
    assert torch.equal(fused.weight_scale, whole.weight_scale) and torch.equal(fused.bias, whole.bias)
    x = torch.randn(4, 48)
    torch.testing.assert_close(fused(x), torch.cat([Fp8Linear.from_linear(p)(x) for p in parts], -1))
    with pytest.raises(ValueError):
        Fp8Linear.concat([nn.Linear(48, 4), nn.Linear(48, 4, bias=False)])


def test_resolve_fp8_switch(monkeypatch):
    monkeypatch.delenv("BLOCKSPEC_FP8", raising=False)
    wide, narrow = fp8_loading.AUTO_MIN_HIDDEN, fp8_loading.AUTO_MIN_HIDDEN - 1
    assert resolve_fp8(True, "cpu", narrow) and not resolve_fp8(False, "cuda", wide)
    assert not resolve_fp8("off", "cuda", wide)
    assert resolve_fp8("auto", "cpu", wide) is False  # auto: CUDA sm_90+ only
    assert resolve_fp8("auto", "cuda", wide) is quantization.fp8_supported("cuda")
    monkeypatch.setattr(fp8_loading, "fp8_supported", lambda device: True)  # as on a Hopper
    assert resolve_fp8(None, "cuda", wide) is True
    assert resolve_fp8(None, "cuda", narrow) is False  # narrow drafters stay bf16
    monkeypatch.setenv("BLOCKSPEC_FP8", "0")
    assert resolve_fp8(None, "cuda", wide) is False
    monkeypatch.setenv("BLOCKSPEC_FP8", "1")
    assert resolve_fp8("auto", "cpu", narrow) is True
    with pytest.raises(ValueError):
        resolve_fp8("sometimes", "cpu", wide)
    monkeypatch.setattr(fp8_loading, "fp8_supported", lambda device: False)  # as on an A100
    for forced in (True, "on", "auto"):  # "auto" with BLOCKSPEC_FP8=1
        with pytest.raises(ValueError, match="FP8 tensor cores"):
            resolve_fp8(forced, "cuda", wide)
    assert resolve_fp8(True, "cpu", wide) is True


# -- swapping a drafter's linears -----------------------------------------------------------------


def tiny_drafter(bias: bool = False) -> DFlashDrafter:
    config = Qwen3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        attention_bias=bias,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        block_size=8,
        dflash_config={"mask_token_id": 127, "target_layer_ids": [1, 2]},
    )
    torch.manual_seed(0)
    drafter = DFlashDrafter(config, 4, 64).eval()
    drafter.fuse_kv()
    return drafter


def test_quantize_linears_swaps_only_the_requested_layers():
    drafter = tiny_drafter()
    x = torch.randn(3, 64)
    mlp_before = drafter.layers[0].mlp(x, drafter.layers[0].post_attention_layernorm) - x  # the MLP's own output
    linears = [n for n, m in drafter.named_modules() if isinstance(m, nn.Linear)]  # either layout: fused or not
    mlp = [n for n in linears if fnmatch.fnmatchcase(n, "layers.*.mlp.*_proj")]
    assert len(mlp) >= 4 and any(n.endswith("down_proj") for n in mlp)
    names = quantize_linears(drafter, "layers.*.mlp.*_proj")
    assert names == mlp
    for name, module in drafter.named_modules():
        if name in names:
            assert isinstance(module, Fp8Linear)
        elif name.endswith("_proj") or name == "fc":
            assert type(module) is Linear, name
    mlp_after = drafter.layers[0].mlp(x, drafter.layers[0].post_attention_layernorm) - x
    assert (mlp_after - mlp_before).norm() / mlp_before.norm() < REL_STEP  # gate, up, down quantized
    # the rest by the default patterns; a callable filter; nothing twice
    names = quantize_linears(drafter, DRAFTER_FP8_PATTERNS)
    assert names == [n for n in linears if n not in mlp] and "fc" in names and "layers.1.self_attn.o_proj" in names
    assert not any(type(m) is Linear for m in drafter.modules())
    assert quantize_linears(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), lambda n: n == "2") == ["2"]


def kv_rows(attn: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's quantized k|v rows (bytes) and scales, with q/k/v as one qkv_proj or three."""
    if hasattr(attn, "qkv_proj"):
        return attn.qkv_proj.weight[attn.q_size :].view(torch.uint8), attn.qkv_proj.weight_scale[attn.q_size :]
    kv = Fp8Linear.concat([attn.k_proj, attn.v_proj])
    return kv.weight.view(torch.uint8), kv.weight_scale


@pytest.mark.parametrize("bias", [False, True])
def test_quantize_drafter_fuses_kv_in_fp8(bias):
    drafter = tiny_drafter(bias)
    features, positions = torch.randn(5, 2 * 64), torch.arange(5)
    k_ref, v_ref = drafter.context_kv(features, positions)
    fused_ref = drafter.fused_kv_weight.clone()
    bias_ref = None if drafter.fused_kv_bias is None else drafter.fused_kv_bias.clone()
    lm_head = nn.Linear(64, 128, bias=False)
    names = quantize_drafter(drafter, lm_head=lm_head)
    assert names[-2:] == ["fused_kv_fp8", "lm_head_fp8"] and drafter.fused_kv_weight is None
    # bit-identical to stacking the k/v rows of the quantized per-layer projections (per-row scales)
    q_rows, scales = zip(*(kv_rows(layer.self_attn) for layer in drafter.layers))
    assert torch.equal(drafter.fused_kv_fp8.weight.view(torch.uint8), torch.cat(q_rows).view(torch.uint8))
    assert torch.equal(drafter.fused_kv_fp8.weight_scale, torch.cat(scales))
    c = torch.randn(5, 64)
    y = drafter.fused_kv_fp8(c)
    assert (y - F.linear(c, fused_ref, bias_ref)).norm() / y.norm() < REL_STEP  # weights and activations rounded
    assert isinstance(drafter.lm_head_fp8, Fp8Linear) and drafter.lm_head_fp8.out_features == 128
    k, v = drafter.context_kv(features, positions)
    assert (k - k_ref).norm() / k_ref.norm() < REL_STEP and (v - v_ref).norm() / v_ref.norm() < REL_STEP


def test_fp8_drafter_keeps_greedy_output_lossless(llama_pair, tmp_path):
    target, drafter = llama_pair
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, return_drafts=True)
    prompts = [[5, 9, 17, 3], [40, 41, 42, 43, 44, 45, 46]]
    plain = [o.outputs[0].token_ids for o in LLM(str(target), None, device="cpu").generate(prompts, params)]
    spec = {"model": str(drafter), "adaptive_width": False}
    bf16 = LLM(str(target), spec, device="cpu")
    bf16_drafts = [o.metrics.draft_token_ids[0] for o in bf16.generate(prompts, params)]
    llm = LLM(str(target), {**spec, "fp8": "on"}, device="cpu", page_size=4)  # made at load
    model = llm.engine.drafter
    linears = [n for n, m in bf16.engine.drafter.named_modules() if isinstance(m, nn.Linear)]
    names = [n for n, m in model.named_modules() if isinstance(m, Fp8Linear)]
    assert names == linears + ["fused_kv_fp8", "lm_head_fp8"] and model.fp8  # every projection of the drafter
    with pytest.raises(ValueError, match="quantized to FP8 for inference"):  # it would lose its projections
        save_drafter(model, llm.engine.target.model, tmp_path / "saved")
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == plain
    # The FP8 drafter still drafts what the unquantized one drafts (first block: same context).
    fp8_drafts = [o.metrics.draft_token_ids[0] for o in outs]
    agree = sum(a == b for x, y in zip(fp8_drafts, bf16_drafts) for a, b in zip(x, y))
    print(f"FP8 drafts equal to the unquantized drafter's: {agree}/{sum(map(len, bf16_drafts))}")
    assert agree >= 0.8 * sum(map(len, bf16_drafts))
