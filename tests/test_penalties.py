"""Repetition, presence and frequency penalties: the per-row rule against a dense reference,
greedy speculative == plain == a reference decoding loop (and transformers' repetition penalty)."""

import pytest
import torch
from conftest import make_drafter, make_target
from transformers import AutoModelForCausalLM

from blockspec import LLM, SamplingParams
from blockspec.penalties import penalize_rows

PROMPTS = [[5, 9, 5, 9, 5], list(range(20, 45)), [7] * 3, [(i * 37) % 120 for i in range(30)]]


def reference_penalty(logits: torch.Tensor, history: list[int], prompt: set[int], p: tuple) -> torch.Tensor:
    """vLLM's rule on one row [V], token by token: repetition over prompt and output tokens, then
    frequency per output occurrence and presence once."""
    presence, frequency, repetition = p
    out = logits.clone()
    for v in range(len(out)):
        n = history.count(v)
        if v in prompt or n:
            out[v] = out[v] / repetition if out[v] > 0 else out[v] * repetition
        out[v] -= frequency * n + presence * (n > 0)
    return out


def test_each_verify_row_counts_the_drafts_before_it():
    """Row r is penalized with the output counts plus drafts 0..r-1 (repeats included): the
    reference rule on each row's own history; counting no drafts (a plain step's rule) differs."""
    gen = torch.Generator().manual_seed(0)
    b, w, v = 3, 6, 11
    logits = torch.randn(b, w, v, generator=gen) * 3
    drafts = torch.randint(0, 5, (b, w - 1), generator=gen)  # few tokens: repeats within a block
    counts = torch.randint(0, 3, (b, v), generator=gen) * (torch.rand(b, v, generator=gen) < 0.3)
    prompt = torch.rand(b, v, generator=gen) < 0.3
    params = [(0.4, 0.3, 1.5), (-0.5, 0.0, 0.7), (0.0, 0.0, 1.0)]
    rows = torch.tensor([[pr, fr, rep - 1, 0.0] for pr, fr, rep in params])
    got = penalize_rows(logits, drafts, counts, prompt, rows)
    for i in range(b):
        base = [t for t in range(v) for _ in range(int(counts[i, t]))]
        seen = {t for t in range(v) if prompt[i, t]}
        for r in range(w):
            history = base + drafts[i, :r].tolist()
            torch.testing.assert_close(got[i, r], reference_penalty(logits[i, r], history, seen, params[i]))
    without = torch.cat([penalize_rows(logits[:, r : r + 1], drafts[:, :0], counts, prompt, rows) for r in range(w)], 1)
    assert torch.equal(without[:, 0], got[:, 0]) and not torch.allclose(without[:2], got[:2])  # drafts count
    assert torch.equal(got[2], logits[2])  # no penalties: the logits as they are


def reference_decode(path, prompt: list[int], n: int, p: tuple) -> list[int]:
    """Greedy decoding with transformers' model and `reference_penalty` on each step's logits."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(reference_penalty(logits, ids[len(prompt) :], set(prompt), p).argmax()))
    return ids[len(prompt) :]


def test_penalized_greedy_speculative_equals_plain_and_the_reference(tmp_path, oracle):
    """Penalized greedy decoding, plain and speculative (drafts that are plain decoding's
    continuation, so blocks are long and hold repeated tokens), equals the reference loop; the
    repetition penalty alone equals transformers' generate with repetition_penalty."""
    t = make_target(tmp_path / "t", "qwen3", vocab=128)
    d = make_drafter(tmp_path / "d", t, block_size=8)
    plain = LLM(str(t), None, device="cpu")
    spec = LLM(str(t), {"model": str(d), "adaptive_width": False}, device="cpu", page_size=4)
    hf = AutoModelForCausalLM.from_pretrained(t, dtype=torch.float32).eval()
    for p in ((0.0, 0.0, 1.3), (0.8, 0.4, 1.0), (0.5, 0.3, 1.2)):
        params = SamplingParams(
            temperature=0, max_tokens=24, ignore_eos=True, presence_penalty=p[0], frequency_penalty=p[1],
            repetition_penalty=p[2],
        )  # fmt: skip
        outs = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params)]
        unpenalized = [
            o.outputs[0].token_ids
            for o in plain.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        ]
        assert outs != unpenalized  # the penalties changed the outputs
        for prompt, out in zip(PROMPTS, outs):
            oracle[tuple(prompt)] = out
            assert out == reference_decode(t, prompt, 24, p)
        spec_outs = spec.generate(PROMPTS, params)
        assert [o.outputs[0].token_ids for o in spec_outs] == outs
        assert max(a for o in spec_outs for a in o.metrics.acceptance_lengths) >= 4  # long blocks verified
        # min_tokens banning a token the outputs never hold: the penalties still apply beside the ban
        unused = next(t for t in range(3, 128) if all(t not in o for o in outs))
        early = SamplingParams(**{**params.__dict__, "min_tokens": 24, "stop_token_ids": [unused]})
        assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, early)] == outs
        if p[:2] == (0.0, 0.0):
            for prompt, out in zip(PROMPTS, outs):
                expected = hf.generate(
                    torch.tensor([prompt]),
                    max_new_tokens=24,
                    do_sample=False,
                    repetition_penalty=p[2],
                    eos_token_id=None,
                )
                assert out == expected[0, len(prompt) :].tolist()


def test_penalties_follow_a_preempted_sequence(tmp_path):
    """A preempted sequence's penalty counts are rebuilt from its tokens: a small pool that preempts
    gives the outputs of a large one."""
    t = make_target(tmp_path / "t", "qwen3", vocab=128)
    d = make_drafter(tmp_path / "d", t, block_size=8)
    params = SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True, frequency_penalty=0.7, repetition_penalty=1.2
    )
    prompts = [list(range(3 + i, 20 + i)) for i in range(6)]
    spec = {"model": str(d)}
    small = LLM(str(t), spec, device="cpu", page_size=4, num_pages=15, max_model_len=48)
    outs = [o.outputs[0].token_ids for o in small.generate(prompts, params)]
    assert small.engine.scheduler.num_preemptions > 0
    alone = LLM(str(t), spec, device="cpu", page_size=4, max_model_len=48)
    assert outs == [o.outputs[0].token_ids for o in alone.generate(prompts, params)]


@pytest.mark.parametrize(
    "field,value", [("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0)]
)
def test_impossible_penalties_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
