"""Incremental detokenization: each new token costs a decode of a few tokens, not of the
whole output. The text of the tokens since `prefix_offset` is decoded with and without
the newest ones; the difference is the new text (the prefix keeps a leading-space or
byte-fallback token decoding as it does in context; the output's first tokens have the
prompt's last ones as theirs, `sequence.PROMPT_CONTEXT`). A trailing U+FFFD means an
incomplete UTF-8 sequence: wait for the next token, or, once the output is final, keep the
text before it."""

from transformers import PreTrainedTokenizerBase

from blockspec.engine.sequence import Sequence


def append_text(tokenizer: PreTrainedTokenizerBase, seq: Sequence, final: bool = False) -> str:
    """Extend seq.text with its undecoded output tokens; returns the text added."""
    ids, end = seq.token_ids, seq.text_end  # slices of the few tokens decoded, not copies of the output
    skip = seq.params.skip_special_tokens
    prefix = tokenizer.decode(ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=skip)
    full = tokenizer.decode(ids[seq.prefix_offset : end], skip_special_tokens=skip)
    if full.endswith("\ufffd"):
        if not final:
            return ""
        full = full.rstrip("\ufffd")
    if len(full) <= len(prefix):
        return ""
    added = full[len(prefix) :]
    seq.text += added
    seq.prefix_offset, seq.read_offset = seq.read_offset, end
    return added


def streamable_text(text: str, finished: bool, stops: list[str]) -> str:
    """The text later steps cannot change: while running, hold back the tail that may still grow
    into a stop string (which is cut off). A partial character never reaches the text while
    running (`append_text` holds it back)."""
    if finished:
        return text
    hold = max((len(s) for s in stops), default=1) - 1
    return text[: max(0, len(text) - hold)]


def find_stop(text: str, added: str, stops: list[str]) -> slice | None:
    """Where in text the first stop string that the newly added text completes is, or None."""
    start = max(0, len(text) - len(added) - max(len(s) for s in stops) + 1)
    hits = [slice(i, i + len(s)) for s in stops if (i := text.find(s, start)) >= 0]
    return min(hits, key=lambda hit: (hit.start, -hit.stop), default=None)
