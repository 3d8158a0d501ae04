"""One request: its tokens, status, block tables and decoding statistics.

Invariant while running: the target has processed (and the drafter holds context K/V for, but
for the last num_deferred) positions 0 .. num_cached-1, and token_ids has exactly one token more: the anchor, the
newest token, which the next step verifies at position num_cached."""

import enum
import itertools
from collections.abc import Container
from typing import TYPE_CHECKING

from blockspec.outputs import TokenLogprob
from blockspec.sampling import SamplingParams

if TYPE_CHECKING:
    from blockspec.engine.kv_cache_manager import BlockTable

_ids = itertools.count()
# Prompt tokens decoded ahead of the output's: a token's leading space or byte-fallback decodes as it
# does in context (a SentencePiece decoder strips the first token's space), as vLLM decodes it
PROMPT_CONTEXT = 5


def fresh_request_id(taken: Container[str] = ()) -> str:
    """The next number, as a string, that is not `taken` (callers may choose numbers as ids)."""
    return next(i for i in map(str, _ids) if i not in taken)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(
        self,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seed: int,
        request_id: str | None = None,
    ) -> None:
        self.request_id = request_id if request_id is not None else fresh_request_id()
        self.prompt = prompt
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.stop_ids: list[int] = []  # the token ids that end it: eos (unless ignored) and stop_token_ids
        self.seed = seed  # int64: keys the counter-based draws of its sampled tokens
        self.status = Status.WAITING
        self.num_cached = 0
        # positions whose drafter context its width-1 steps deferred (`engine.step.defer_context`),
        # steps launched but not yet committed among them: not yet in the drafter's cache
        self.num_deferred = 0
        self.block_tables: list[BlockTable] = []  # one per cache group (`KVCacheManager.tables`)
        self.page_hashes: list[bytes] = []  # prefix hashes of its leading pages (`KVCacheManager.register`)
        self.state_slot = 0  # its linear-attention layers' state slot while it runs (0: none held)
        # prefix caching of a linear-attention target: a page boundary its prefill chunks end at, so
        # that its states there are checkpointed (`KVCacheManager.match_prefix`); 0: none
        self.checkpoint_position = 0
        self.grammar = None  # structured output: its xgrammar GrammarMatcher, fed the committed tokens
        self.finish_reason: str | None = None
        # by eos or a stop token id: its text is left out, as vLLM does (unless include_stop_str_in_output)
        self.stopped_on_token = False
        self.text = ""  # detokenized output
        # incremental detokenization (detokenizer.py): positions in token_ids, from PROMPT_CONTEXT prompt tokens
        self.prefix_offset = self.num_prompt_tokens - min(PROMPT_CONTEXT, self.num_prompt_tokens)
        self.read_offset = self.num_prompt_tokens
        self.acceptance_lengths: list[int] = []
        self.draft_token_ids: list[list[int]] = []
        self.logprobs: list[TokenLogprob] = []  # of each output token, with SamplingParams(logprobs=k)
        # of each prompt token after the first, with SamplingParams(prompt_logprobs=k), as prefilled
        self.prompt_logprobs: list[TokenLogprob] = []

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def text_end(self) -> int:
        """Where in token_ids the tokens whose text is the output text end (a stop token's is left out)."""
        return len(self.token_ids) - self.stopped_on_token

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def tokens_left(self) -> int:
        """Tokens it may still generate before max_tokens."""
        return self.params.max_tokens - self.num_generated

    @property
    def anchor(self) -> int:
        return self.token_ids[-1]

    @property
    def num_pending_prefill(self) -> int:
        """Tokens the target must process before the next step: all but the anchor."""
        return len(self.token_ids) - 1 - self.num_cached

    @property
    def needs_prefill(self) -> bool:
        return self.num_pending_prefill > 0

    @property
    def seeded_sample(self) -> bool:
        """A seeded sampled request: reproducible only if its blocks start where they always do."""
        return self.params.seed is not None and not self.params.greedy

    @property
    def finished(self) -> bool:
        return self.status == Status.FINISHED
