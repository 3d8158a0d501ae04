"""The real measure of a trained drafter: the engine's mean acceptance length (tau, per
speculative step, bonus token included) on prompts it was not trained on, greedy decoding."""

from collections import Counter
from pathlib import Path

import torch

from blockspec.llm import LLM
from blockspec.sampling import SamplingParams


def acceptance_lengths(
    model: str | None, drafter_dir: str | Path, prompts: list[list[int]], max_tokens: int, device: torch.device
) -> list[int]:
    """Every speculative step's tau over all prompts (pooled), at the full block width."""
    spec = {"model": str(drafter_dir), "adaptive_width": False}
    # tau, not speed: graphs are captured as the run needs them (`train.data.generator`)
    llm = LLM(model, spec, device=device, max_num_seqs=max(1, min(64, len(prompts))), warm_up=False)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return [n for o in outputs for n in o.metrics.acceptance_lengths]


def describe(taus: list[int]) -> str:
    hist = Counter(taus)
    counts = " ".join(f"{k}:{hist[k]}" for k in sorted(hist))
    return f"mean acceptance length {sum(taus) / max(1, len(taus)):.3f} over {len(taus)} steps (histogram {counts})"
