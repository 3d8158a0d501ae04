"""The shipped pair: the embedded SmolLM2 target with the DFlash drafter in blockspec/assets,
speculation on by default, lossless against plain decoding, and actually trained."""

import pytest
import torch
from conftest import count_launches_ahead

from blockspec import LLM, SamplingParams
from blockspec.bench.presets import random_drafter, random_target
from blockspec.cli import GREEN, RESET, marked_text
from blockspec.llm import DEFAULT_DRAFTER
from blockspec.loading.gguf import default_gguf_path
from blockspec.outputs import CompletionOutput, RequestMetrics, RequestOutput

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a hash table is.",
]


@pytest.fixture(scope="module")
def pair() -> tuple[LLM, LLM]:
    try:
        default_gguf_path()
    except FileNotFoundError as exc:
        pytest.skip(f"embedded GGUF target absent: {exc}")
    torch.manual_seed(0)
    return LLM(device="cpu", dtype="float32"), LLM(device="cpu", dtype="float32", speculative_config=None)


def test_default_is_the_shipped_drafter(pair: tuple[LLM, LLM]) -> None:
    spec, plain = pair
    assert (DEFAULT_DRAFTER / "config.json").is_file()
    assert spec.engine.drafter is not None and spec.engine.max_width == spec.engine.drafter.block_size == 16
    assert plain.engine.drafter is None and plain.engine.max_width == 1


def test_shipped_pair_is_lossless_and_trained(pair: tuple[LLM, LLM]) -> None:
    spec, plain = pair
    prompts = [spec.chat_prompt([{"role": "user", "content": p}]) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=64)
    fast, slow = spec.generate(prompts, params), plain.generate(prompts, params)
    for f, s in zip(fast, slow):
        assert f.outputs[0].token_ids == s.outputs[0].token_ids
        assert f.outputs[0].text == s.outputs[0].text
    # tau at the full block: adaptive width (the default) follows step timings, which the machine's load moves
    full = LLM(
        device="cpu", dtype="float32", speculative_config={"model": str(DEFAULT_DRAFTER), "adaptive_width": False}
    )
    lengths = [a for f in full.generate(prompts, params) for a in f.metrics.acceptance_lengths]
    tau = sum(lengths) / len(lengths)
    # An untrained drafter accepts almost nothing (tau ~1.0); this one measures 2.1-3.1 on MT-Bench and HumanEval.
    assert tau > 1.6, f"mean acceptance length {tau:.2f}"


def test_marked_text_highlights_accepted_drafts(pair: tuple[LLM, LLM]) -> None:
    spec, _ = pair
    prompt = spec.chat_prompt([{"role": "user", "content": PROMPTS[0]}])
    out = spec.generate(prompt, SamplingParams(temperature=0, max_tokens=48, return_drafts=True))[0]
    marked = marked_text(spec, out)
    assert marked.replace(GREEN, "").replace(RESET, "") == out.outputs[0].text
    assert marked.count(GREEN) == sum(n > 1 for n in out.metrics.acceptance_lengths) > 0


def test_marked_text_keeps_characters_split_across_tokens(pair: tuple[LLM, LLM]) -> None:
    """Steps that end inside a multi-byte character: the marks must not change the text."""
    spec, _ = pair
    text = "time complexity of O(√n) and é is 日本"
    ids = spec.tokenizer.encode(text, add_special_tokens=False)
    for cut in range(1, len(ids)):
        steps = RequestMetrics([cut, len(ids) - cut])
        out = RequestOutput("r", None, [], [CompletionOutput(0, text, ids, "stop")], True, steps)
        marked = marked_text(spec, out)
        assert marked.replace(GREEN, "").replace(RESET, "") == text, cut
    # stopped on a (non-special) stop token: its text is not in the output, nor in the marked text
    stopped = spec.tokenizer.decode(ids[:-1])
    out = RequestOutput("r", None, [], [CompletionOutput(0, stopped, ids, "stop")], True, RequestMetrics([len(ids)]))
    assert marked_text(spec, out).replace(GREEN, "").replace(RESET, "") == stopped


def test_steps_launched_ahead_change_nothing(pair: tuple[LLM, LLM]) -> None:
    """Each step launched from the results of the one in flight, still on the device (as on a
    GPU), gives the lock-step engine's output: greedy token for token, and seeded samples."""
    spec, _ = pair
    ahead = LLM(device="cpu", dtype="float32", async_steps=True)
    launched = count_launches_ahead(ahead)
    prompts = [spec.chat_prompt([{"role": "user", "content": p}]) for p in PROMPTS]
    greedy = SamplingParams(temperature=0, max_tokens=48)
    seeded = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=48, seed=i) for i in range(len(prompts))]
    lengths = []
    for params in (greedy, seeded):
        fast, lock_step = ahead.generate(prompts, params), spec.generate(prompts, params)
        for f, s in zip(fast, lock_step):
            assert f.outputs[0].token_ids == s.outputs[0].token_ids
            assert f.outputs[0].text == s.outputs[0].text
            lengths += f.metrics.acceptance_lengths
    assert sum(launched) > 20  # most steps were launched ahead
    assert max(lengths) > 3  # blocks with accepted drafts moved the next anchor on the device


def shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in module.state_dict().items()}


def test_smollm2_presets_have_the_shipped_pairs_geometry(pair: tuple[LLM, LLM]) -> None:
    """`random:SmolLM2-135M` and its drafter presets time the shipped pair without the GGUF: every
    tensor the loaded pair has, in the same shape; the DSpark preset adds only its two heads."""
    spec, _ = pair
    meta = torch.device("meta")
    target = random_target("random:SmolLM2-135M", torch.float32, meta).model
    assert shapes(target) == shapes(spec.engine.target.model)
    drafter = shapes(random_drafter("random:SmolLM2-135M-DFlash", target, torch.float32, meta))
    assert drafter == shapes(spec.engine.drafter)
    dspark = shapes(random_drafter("random:SmolLM2-135M-DSpark", target, torch.float32, meta))
    extra = {name.split(".")[0] for name in dspark.keys() - drafter.keys()}
    assert extra == {"markov_head", "confidence_head"} and drafter.items() <= dspark.items()
