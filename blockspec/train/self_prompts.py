"""Prompts the target writes itself (Magpie, Xu et al. 2024): an instruct model given its chat
template up to where a user's message begins continues with a user's request, drawn from the
chats it was tuned on. That gives general chat (writing, role-play, reasoning, questions of fact)
in the mix the target expects, which prompts built from code and manuals lack, with no data set
and no network. `blockspec train --write-prompts FILE --prompt-source target` writes them."""

from dataclasses import dataclass

from blockspec.llm import LLM
from blockspec.sampling import SamplingParams

MARKER = "BLOCKSPEC_USER_MESSAGE"  # stands for the message in the rendered template
MIN_CHARS = 12  # a shorter request ("Hi!") asks for little to answer
MAX_TOKENS = 128  # a request's length cap: one cut off there is dropped
ROUNDS = 20  # batches of draws before giving up on reaching the number asked for


@dataclass(frozen=True)
class UserTurn:
    prefix: list[int]  # the template's ids up to a user's message (a default system prompt included)
    end: int  # the id that closes a user's message


def user_turn(llm: LLM) -> UserTurn:
    """Where a user's message begins and what ends it, from the chat template rendered around a
    marker."""
    tok = llm.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise ValueError("--prompt-source target needs a target with a chat template")
    text = tok.apply_chat_template([{"role": "user", "content": MARKER}], tokenize=False)
    head, marker, tail = text.partition(MARKER)
    after = tok.encode(tail, add_special_tokens=False)
    if not marker or not after:
        raise ValueError("the chat template does not show where a user's message ends")
    return UserTurn(tok.encode(head, add_special_tokens=False), after[0])


def target_prompts(llm: LLM, n: int, seed: int, max_tokens: int = MAX_TOKENS) -> list[str]:
    """n distinct user requests the target writes at temperature 1, each ended by the template's
    end of a user turn within `max_tokens` (one cut off is dropped, as is one under MIN_CHARS).
    Draw k of a seed is seeded by (seed, k): reproducible where the engine's sampling is."""
    turn = user_turn(llm)
    prompts: dict[str, None] = {}  # distinct, in the order drawn
    drawn = 0
    for _ in range(ROUNDS):
        left = n - len(prompts)
        if left <= 0:
            break
        count = left + left // 4 + 8  # some draws fail the checks
        params = [
            SamplingParams(1.0, max_tokens=max_tokens, stop_token_ids=[turn.end], seed=seed * 1_000_003 + k)
            for k in range(drawn, drawn + count)
        ]
        drawn += count
        for out in llm.generate([turn.prefix] * count, params):
            text = out.outputs[0].text.strip()
            if out.outputs[0].finish_reason == "stop" and len(text) >= MIN_CHARS:
                prompts.setdefault(text)
    if len(prompts) < n:
        raise ValueError(f"the target wrote {len(prompts)} usable prompts of {n} in {drawn} draws")
    return list(prompts)[:n]
