"""The CUDA fast path (CUDA graphs, Triton kernels) against the reference path. Skipped
without a GPU; run on the GPU machine."""

import pytest
import torch
from conftest import make_drafter, make_target

from blockspec import LLM, SamplingParams
from blockspec.bench.presets import random_drafter, random_target
from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.engine.engine import LLMEngine
from blockspec.layers import attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
PROMPTS = [[5, 9, 2, 11], list(range(20, 57)), [7] * 3, [(i * 37) % 120 for i in range(70)]]


def outputs(llm, prompts=PROMPTS, n=24):
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_fp32_fast_path_equals_cpu_reference(tmp_path):
    t = make_target(tmp_path / "t", "qwen3", vocab=128)
    d = make_drafter(tmp_path / "d", t, block_size=8)
    for spec in (None, {"model": str(d)}):
        cpu = outputs(LLM(str(t), spec, device="cpu"))
        gpu = outputs(LLM(str(t), spec, device="cuda", dtype="float32"))
        assert gpu == cpu


def test_fast_attention_matches_reference_in_the_model(tmp_path):
    t = make_target(tmp_path / "t", "llama", vocab=128)
    d = make_drafter(tmp_path / "d", t, block_size=8)
    llm = LLM(str(t), {"model": str(d)}, device="cuda", dtype="float32")
    fast = outputs(llm)
    with attention.reference_ops():
        ref = outputs(LLM(str(t), {"model": str(d)}, device="cuda", dtype="float32", cuda_graphs=False))
    assert fast == ref


def engine(target, drafter, graphs: bool) -> LLMEngine:
    spec = SpeculativeConfig(num_speculative_tokens=15) if drafter is not None else None
    return LLMEngine(target, drafter, spec, EngineConfig(max_num_seqs=8, max_model_len=1024, cuda_graphs=graphs))


def test_bf16_real_geometry_agreement():
    """Greedy tokens of the fast path (graphs, Triton, fused ops) vs what the reference path
    predicts for the same histories (teacher forcing): random weights make near-ties common,
    so each position is judged under the same context."""
    dev = torch.device("cuda")
    target = random_target("random:Qwen3-8B", torch.bfloat16, dev)
    drafter = random_drafter("random:Qwen3-8B-DFlash-b16", target.model, torch.bfloat16, dev)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 151000, (n,), generator=gen).tolist() for n in (17, 130, 300, 64)]
    eng = engine(target, drafter, graphs=True)
    seqs = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)) for p in prompts]
    while eng.has_unfinished():
        eng.step()
    ref = engine(target, None, graphs=False)
    agree = total = 0
    with attention.reference_ops(), torch.inference_mode():
        for s in seqs:
            ids = torch.tensor([s.token_ids], device=dev)
            n = len(s.token_ids)
            tables = torch.arange(1, 1 + -(-n // 16), device=dev)[None]
            hidden, _ = ref.runner.target_forward(
                ids, torch.zeros(1, dtype=torch.long, device=dev), torch.tensor([n], device=dev), tables
            )
            predicted = target.model.compute_logits(hidden)[0].argmax(-1)[s.num_prompt_tokens - 1 : -1]
            agree += (predicted == torch.tensor(s.output_token_ids, device=dev)).sum().item()
            total += len(s.output_token_ids)
    print(f"bf16 Qwen3-8B geometry: {agree}/{total} greedy tokens of the fast path equal the reference's")
    assert agree / total >= 0.99
