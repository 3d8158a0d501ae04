"""What generate() returns (vLLM's shapes)."""

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """An output token's log-probability under the target, and the most likely tokens' (id -> log p)."""

    token_id: int
    logprob: float
    top: dict[int, float]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    logprobs: list[TokenLogprob] | None = None  # one per token, with SamplingParams(logprobs=k)


@dataclass
class RequestMetrics:
    acceptance_lengths: list[int] = field(default_factory=list)  # tokens committed per step, incl. bonus
    draft_token_ids: list[list[int]] | None = None  # per step, with SamplingParams(return_drafts=True)

    @property
    def mean_acceptance_length(self) -> float:
        return sum(self.acceptance_lengths) / max(1, len(self.acceptance_lengths))


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # with SamplingParams(prompt_logprobs=k): None for the first prompt token, then one per token
    prompt_logprobs: list[TokenLogprob | None] | None = None
