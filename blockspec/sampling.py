"""Sampling parameters, the target/drafter token distributions they define, and the
acceptance rules of speculative decoding (greedy prefix match; rejection sampling)."""

import math
import numbers
from dataclasses import dataclass, field

import torch

from blockspec.layers.fast_path import fast_kernels


def is_int(value) -> bool:
    """An integer (numpy's too), not a bool (which Python counts as one): for checks of parsed JSON too."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


class InvalidSamplingParam(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param  # the field at fault (the server's error names it)


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0  # 0: off
    max_tokens: int | None = 16  # None: until the context is full
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    return_drafts: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        checks = {
            "temperature": (
                is_number(self.temperature) and 0 <= self.temperature < math.inf,
                f"must be >= 0 and finite, got {self.temperature}",
            ),
            "top_p": (is_number(self.top_p) and 0 < self.top_p <= 1, f"must be in (0, 1], got {self.top_p}"),
            "top_k": (is_int(self.top_k) and self.top_k >= -1, f"must be -1, 0 or positive, got {self.top_k}"),
            "min_p": (is_number(self.min_p) and 0 <= self.min_p <= 1, f"must be in [0, 1], got {self.min_p}"),
            "max_tokens": (
                self.max_tokens is None or is_int(self.max_tokens) and self.max_tokens >= 1,
                f"must be >= 1 or None, got {self.max_tokens}",
            ),
            "stop": (all(isinstance(s, str) and s for s in self.stop), "strings must be non-empty strings"),
            "stop_token_ids": (
                all(is_int(t) and t >= 0 for t in self.stop_token_ids),
                "must be non-negative ints",
            ),
            "seed": (
                self.seed is None or is_int(self.seed) and -(2**63) <= self.seed < 2**64,
                f"must be a 64-bit int, got {self.seed!r}",
            ),
        }
        for name, (ok, message) in checks.items():
            if not ok:
                raise InvalidSamplingParam(name, f"{name} {message}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def token_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sampling draws from: softmax(logits / T), restricted to the top-k
    tokens, then to the smallest top set with mass >= top_p, then to the tokens with at least
    min_p times the top probability (transformers' order). logits: [..., V]."""
    logits = logits.float()
    # Shifted so the top score is 0 before dividing: a tiny T sends the others to -inf (the
    # argmax limit), where logits / T would overflow to inf and softmax to NaN.
    scores = (logits - logits.amax(-1, keepdim=True)) / params.temperature
    if 0 < params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(outside, 0))
        probs = probs / probs.sum(-1, keepdim=True)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), 0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of probs [R, V], drawn as torch.multinomial(probs, 1) draws it, by the
    exponential race argmax(p / E) with E ~ Exp(1) (the same tokens and generator state, bit for
    bit), but without multinomial's check of probs, whose .item() waits for the device."""
    return argmax(probs / torch.empty_like(probs).exponential_(1, generator=generator))


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """The greedy tokens: logits.argmax(-1); on CUDA without grad, for 16- and 32-bit floats, by a
    Triton kernel (torch's reduction gives a row one program: see `blockspec.layers.kernels.argmax`)."""
    kernels = fast_kernels(logits, "argmax")
    if kernels is not None and logits.dtype in kernels.DTYPES:
        return kernels.argmax_triton(logits)
    return logits.argmax(dim=-1)


def greedy_accept(drafts: torch.Tensor, target_argmax: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """Accepted drafts per sequence: the longest prefix with d_i == argmax of target row i-1.
    drafts: [B, S-1]; target_argmax: [B, S]; num_drafts: [B] (rows past it never accept)."""
    cols = torch.arange(drafts.shape[1], device=drafts.device)
    match = (drafts == target_argmax[:, :-1]) & (cols < num_drafts[:, None])
    return match.int().cumprod(dim=1).sum(dim=1)


def rejection_sample(
    drafts: torch.Tensor, p: torch.Tensor, q: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling for one sequence: accept d_i with probability min(1, p/q); on the
    first rejection draw from normalize(max(p - q, 0)); if all are accepted, the bonus is
    drawn from p's last row. drafts: [R]; p: [R+1, V]; q: [R, V]. Returns (accepted, token)
    as device scalars: nothing here waits for the device."""
    R = len(drafts)
    rows = torch.arange(R, device=p.device)
    u = torch.rand(R, generator=generator, device=p.device)
    accepted = (u * q[rows, drafts] < p[rows, drafts]).int().cumprod(0).sum()
    row = accepted.view(1)  # a 1-d index: p[0-d tensor] would read it on the host first
    # Past the last draft q counts as zero, so "all accepted" is the same rule: max(p[R] - 0, 0).
    q_row = torch.where(row < R, q[row.clamp(max=R - 1)], 0.0) if R else 0.0
    residual = (p[row] - q_row).clamp_min(0)
    # max(p - q, 0) is all zero only when p == q, where rejection has probability 0.
    residual = torch.where(residual.sum() > 0, residual, p[row])
    return accepted, sample(residual / residual.sum(), generator)[0]
