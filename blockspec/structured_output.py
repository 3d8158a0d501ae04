"""Structured output: a request's grammar (a JSON schema, any JSON object, a regular expression, one
of a list of strings or an EBNF grammar), compiled by xgrammar, and the token masks that hold each
verify row to it.

Row j of a step decides the token after the anchor and drafts d_1..d_j, so its mask is the
grammar's state after them: the host walks each block's drafts through the sequence's matcher,
filling a row's mask before accepting the next draft, and rolls the matcher back after. The masks
apply to the target's logits only (`mask_logits`): a draft the grammar forbids has target
probability 0, so the acceptance rule rejects it (greedy or sampled) and draws the residual from
the masked distribution; the drafts and their distribution q stay as drawn, so the output has
exactly the distribution of constrained plain decoding. The rows after a forbidden draft are never
reached, and are left unmasked. The matcher takes the committed tokens (`GrammarMatcher.accept_token`)."""

import importlib.util
import json
from dataclasses import dataclass

import numpy as np
import torch

from blockspec.layers.fast_path import cuda_compiled

XGRAMMAR_HINT = "structured output needs xgrammar: pip install xgrammar"


def xgrammar_installed() -> bool:
    return importlib.util.find_spec("xgrammar") is not None


@dataclass(frozen=True)
class StructuredOutput:
    """The grammar a request's output must follow: exactly one of its fields set. JSON carries no
    free whitespace (Python's json.dumps separators): a model cannot pad it without end."""

    json: str | dict | None = None  # a JSON schema, as a dict or its JSON text
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None  # exactly one of these strings
    grammar: str | None = None  # EBNF (xgrammar's dialect of GBNF)

    def __post_init__(self) -> None:
        given = [self.json, self.regex, self.choice, self.grammar]
        if sum(x is not None for x in given) + self.json_object != 1:
            raise ValueError("a StructuredOutput sets exactly one of json, json_object, regex, choice and grammar")
        if self.choice is not None and not (self.choice and all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("choice is a list of non-empty strings")

    def compile(self, compiler):
        """The xgrammar CompiledGrammar (the compiler caches it); ValueError where it does not compile."""
        try:
            if self.json is not None:
                schema = self.json if isinstance(self.json, str) else json.dumps(self.json)
                return compiler.compile_json_schema(schema, any_whitespace=False)
            if self.json_object:
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if self.regex is not None:
                return compiler.compile_regex(self.regex)
            if self.choice is not None:  # EBNF string literals escape as JSON strings do (non-ASCII as it is:
                # xgrammar reads the \u escapes of a surrogate pair as two lone surrogates)
                literals = (json.dumps(c, ensure_ascii=False) for c in self.choice)
                return compiler.compile_grammar("root ::= " + " | ".join(literals))
            return compiler.compile_grammar(self.grammar)
        except RuntimeError as e:  # xgrammar's errors on a bad schema, regex or grammar
            raise ValueError(f"the grammar does not compile: {e}") from e


class Grammars:
    """Matchers of requests' grammars over one tokenizer's vocabulary (xgrammar imported at the
    first structured request: it is an optional dependency)."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        try:
            import xgrammar
        except ImportError as e:
            raise ValueError(XGRAMMAR_HINT) from e
        if tokenizer is None:
            raise ValueError("structured output needs the model's tokenizer, and this model has none")
        self.xgrammar = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgrammar.GrammarCompiler(info)
        self.vocab_size = vocab_size

    def compile(self, spec: StructuredOutput):
        """The spec's CompiledGrammar, from the compiler's cache after the first time (any thread)."""
        return spec.compile(self.compiler)

    def matcher(self, spec: StructuredOutput, stop_ids: list[int]):
        """A fresh GrammarMatcher of the spec whose end is any of stop_ids (the request's eos and
        stop tokens: the only tokens allowed once the grammar is complete)."""
        if not stop_ids:
            raise ValueError("structured output ends at a stop token, and this request has none (ignore_eos)")
        matcher = self.xgrammar.GrammarMatcher(self.compile(spec), override_stop_tokens=stop_ids)
        if self.allows_nothing(matcher):
            raise ValueError("the grammar allows none of the vocabulary's tokens to begin with")
        return matcher

    def allows_nothing(self, matcher) -> bool:
        """Whether the matcher is at a dead end: no token of the vocabulary goes on from its state."""
        mask = self.xgrammar.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(mask)
        return not mask.any()


def token_bitmasks(matchers: list, blocks: list[list[int]], width: int, vocab_size: int) -> np.ndarray:
    """[B, width, W] int32 token bitmasks (bit v % 32 of word v // 32: token v allowed; W even, so
    a row crosses to the device as int64) of each sequence's rows: blocks[b] is its anchor and
    drafts, matchers[b] its matcher (None: unconstrained, all bits set)."""
    words = -(-vocab_size // 32)
    masks = torch.full((len(blocks) * width, words), -1, dtype=torch.int32)
    for b, (matcher, block) in enumerate(zip(matchers, blocks)):
        if matcher is not None:
            fill_rows(matcher, block, masks[b * width : (b + 1) * width])
    masks = masks.numpy()
    if words % 2:  # a copy only where the width is odd
        masks = np.pad(masks, ((0, 0), (0, 1)), constant_values=-1)
    return masks.reshape(len(blocks), width, -1)


def fill_rows(matcher, block: list[int], masks: torch.Tensor) -> None:
    """Row j's mask: the grammar's state after block[1 : j + 1]; the rows after a draft the grammar
    forbids (or after one that ends it) keep all bits set. The matcher ends where it started."""
    advanced = 0
    for j in range(len(block)):
        matcher.fill_next_token_bitmask(masks, j)
        if j + 1 == len(block) or not matcher.accept_token(block[j + 1]):
            break
        advanced += 1
        if matcher.is_terminated():
            break
    matcher.rollback(advanced)


@cuda_compiled  # on CUDA one pass over the logits
def mask_logits(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [..., V] with the tokens each row's bitmask [..., W] (int32, `token_bitmasks`) leaves
    out at -inf."""
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    allowed = (bitmask[..., vocab // 32] >> (vocab % 32)) & 1
    return logits.masked_fill(allowed == 0, float("-inf"))
