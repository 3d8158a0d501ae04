"""OpenAI requests in, engine requests out; engine outputs back as OpenAI responses, whole
or as server-sent events. A request's choices (`n`, and a batched completion's prompts) are one
engine request each, decoded in the same batch."""

import asyncio
import functools
import itertools
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import ClassVar, TypeVar

from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from jinja2 import TemplateError
from pydantic import BaseModel
from tokenizers import decoders
from transformers import PreTrainedTokenizerBase
from transformers.convert_slow_tokenizer import bytes_to_unicode

from blockspec.engine.detokenizer import streamable_text
from blockspec.llm import LLM
from blockspec.outputs import RequestOutput, TokenLogprob
from blockspec.sampling import InvalidSamplingParam, SamplingParams
from blockspec.server.async_engine import AsyncEngine, EngineError
from blockspec.server.protocol import (
    IGNORED,
    MAX_CHOICES,
    UNSUPPORTED,
    APIError,
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    Envelope,
    SamplingRequest,
    SpecDecodingStats,
    TopLogprob,
    UsageInfo,
    bad_request,
)

T = TypeVar("T")
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context
# Values of an unsupported field that ask for nothing, besides null, false, 0, "", [] and {}
ALSO_OFF = {
    "best_of": (1,),
    "repetition_penalty": (1,),
    "tool_choice": ("none",),
}
SEED_STEP = 0x9E3779B97F4A7C15  # choice i of a seeded request draws with seed + i * SEED_STEP (mod 2**64)
BYTE_OF_CHAR = {char: byte for byte, char in bytes_to_unicode().items()}  # byte-level BPE's stand-ins for bytes
BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's token of a byte no piece covers


def feature_off(name: str, value) -> bool:
    """Whether an unsupported field asks for nothing (clients send frequency_penalty 0, logit_bias {})."""
    return not value or value in ALSO_OFF.get(name, ())


def byte_level(tokenizer: PreTrainedTokenizerBase) -> bool:
    """GPT-2's byte-level BPE (Llama 3's, Qwen's): each byte of a token spelled as a printable character."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and isinstance(backend.decoder, decoders.ByteLevel)


def vocab_bytes(tokenizer: PreTrainedTokenizerBase, token_id: int) -> bytes:
    """A token's raw bytes from its vocabulary entry: a token that is part of a UTF-8 character
    keeps its own bytes, which its decoded text (U+FFFD) has lost."""
    added = tokenizer.added_tokens_decoder.get(token_id)
    if added is not None:
        return added.content.encode()
    token = tokenizer.convert_ids_to_tokens(token_id) or ""  # None: an id past the vocabulary
    if byte_level(tokenizer) and set(token) <= BYTE_OF_CHAR.keys():  # a stray character: its text, not a 500
        return bytes(BYTE_OF_CHAR[c] for c in token)
    byte = BYTE_FALLBACK.fullmatch(token)
    return bytes([int(byte[1], 16)]) if byte else token.replace("\u2581", " ").encode()  # SentencePiece's space


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of a request's choice `index` (choice 0: the request's own), a signed 64-bit int:
    seeded choices differ from each other, and each reproduces."""
    if seed is None:
        return None
    s = (seed + index * SEED_STEP) % 2**64
    return s - 2**64 if s >= 2**63 else s


@dataclass
class Choice:
    """One choice of a request, decoded as an engine request of its own."""

    index: int
    prompt: int  # which of the request's prompts it continues
    prompt_ids: list[int]
    params: SamplingParams
    echo: str = ""  # text before the generated text (a completion's echoed prompt)


def usage(choices: list[Choice], outs: Iterable[RequestOutput]) -> UsageInfo:
    """Each prompt counted once (its n choices share it), and every choice's tokens."""
    prompt = sum({c.prompt: len(c.prompt_ids) for c in choices}.values())
    completion = sum(len(o.outputs[0].token_ids) for o in outs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def spec_stats(outs: Iterable[RequestOutput]) -> SpecDecodingStats:
    """The speculative steps of the given choices' engine requests, together."""
    lengths = [n for o in outs for n in o.metrics.acceptance_lengths]
    drafts = [d for o in outs for d in o.metrics.draft_token_ids or []]
    return SpecDecodingStats(
        acceptance_lengths=lengths,
        mean_acceptance_length=sum(lengths) / max(1, len(lengths)),
        num_steps=len(lengths),
        num_draft_tokens=sum(map(len, drafts)),
        num_accepted_tokens=sum(lengths) - len(lengths),  # every step commits one bonus token
    )


def sse(chunk: BaseModel | dict) -> str:
    data = chunk.model_dump_json() if isinstance(chunk, BaseModel) else json.dumps(chunk)
    return f"data: {data}\n\n"


async def final_output(first: RequestOutput, outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    out = first
    async for out in outputs:  # the last one is the answer
        pass
    return out


async def first_outputs(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """Each stream's first output. If the engine refuses one choice, the others are aborted and
    the refusal raised: a request is answered whole or not at all."""
    firsts = await asyncio.gather(*map(anext, streams), return_exceptions=True)
    failed = [f for f in firsts if isinstance(f, BaseException)]
    if failed:
        for stream in streams:
            await stream.aclose()
        raise failed[0]
    return firsts


async def merged(
    firsts: list[RequestOutput], streams: list[AsyncIterator[RequestOutput]]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(position, output) of every choice's outputs as they come, until all finish. The queue holds
    as many items as there are choices: a client that stops reading makes the engine's side keep
    only each choice's newest output (`AsyncEngine.generate`), not every one."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))

    async def forward(i: int, first: RequestOutput, stream: AsyncIterator[RequestOutput]) -> None:
        async with aclosing(stream):
            try:
                await queue.put((i, first))
                async for out in stream:
                    await queue.put((i, out))
            except EngineError as e:
                await queue.put((i, e))

    tasks = [asyncio.ensure_future(forward(i, f, s)) for i, (f, s) in enumerate(zip(firsts, streams))]
    try:
        pending = len(streams)
        while pending:
            i, item = await queue.get()
            if isinstance(item, EngineError):
                raise item
            pending -= item.finished
            yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:  # a task cancelled before it ran never opened its stream: abort it here
            await stream.aclose()


def as_api_error(e: EngineError) -> APIError:
    return bad_request(str(e), e.param) if e.bad_request else APIError(500, str(e), "server_error")


async def wait_disconnect(request: Request) -> None:
    # The body was read already, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, or cancel it if the client disconnects first (which aborts its request)."""
    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(wait_disconnect(request))
    try:
        done, _ = await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        task.cancel()  # a no-op once it is done
    if task not in done:
        raise APIError(499, "the client closed the request", code="client_closed_request")
    return task.result()


@dataclass
class Format:
    """Builds one request's response objects: `whole` holds a response's choices, `streamed` a
    chunk's; subclasses give the endpoint's choice shapes (`item`, `chunk_item`). A chunk carries
    the text after the `sent` characters of the choice's so far, and the log-probabilities of the
    tokens since its last chunk (`new`)."""

    whole: ClassVar[type[Envelope]]
    streamed: ClassVar[type[Envelope]]
    id: str
    model: str
    token_text: Callable[[int], str]  # a token id as logprobs show it
    created: int = field(default_factory=lambda: int(time.time()))

    def head(self) -> dict:
        return {"id": self.id, "model": self.model, "created": self.created}

    def opening(self, choices: list[Choice]) -> list[BaseModel]:
        return []

    def response(self, choices: list[Choice], outs: list[RequestOutput]) -> BaseModel:
        items = [self.item(c, o) for c, o in zip(choices, outs)]
        return self.whole(**self.head(), choices=items, usage=usage(choices, outs), spec_decoding=spec_stats(outs))

    def chunk(
        self, choice: Choice, sent: int, delta: str, out: RequestOutput, new: list[TokenLogprob] | None
    ) -> BaseModel:
        item = self.chunk_item(choice, sent, delta, out, new)
        return self.streamed(**self.head(), choices=[item], **finished_stats(out))

    def usage_chunk(self, usage: UsageInfo) -> BaseModel:
        return self.streamed(**self.head(), choices=[], usage=usage)


class CompletionFormat(Format):
    whole = streamed = CompletionResponse  # OpenAI streams the same object

    def logprobs(self, lps: list[TokenLogprob | int] | None, offset: int) -> CompletionLogprobs | None:
        """OpenAI's legacy shape; text offsets from `offset` on, each token's text after the last's. A
        bare token id (an echoed prompt's first token) has no log-probability: null."""
        if lps is None:
            return None
        tokens = [self.token_text(lp if isinstance(lp, int) else lp.token_id) for lp in lps]
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[None if isinstance(lp, int) else lp.logprob for lp in lps],
            top_logprobs=[
                None if isinstance(lp, int) else {self.token_text(t): v for t, v in lp.top.items()} for lp in lps
            ],
            text_offset=list(itertools.accumulate(map(len, tokens[:-1]), initial=offset)) if tokens else [],
        )

    @staticmethod
    def echoed(choice: Choice, out: RequestOutput) -> list[TokenLogprob | int]:
        """The echoed prompt's entries (its first token bare), where the choice echoes it with logprobs."""
        if not choice.echo or out.prompt_logprobs is None:
            return []
        return [out.prompt_token_ids[0], *out.prompt_logprobs[1:]]

    def item(self, choice: Choice, out: RequestOutput) -> CompletionChoice:
        o = out.outputs[0]
        prompt = self.echoed(choice, out)
        offset = 0 if prompt else len(choice.echo)
        logprobs = self.logprobs(prompt + o.logprobs if o.logprobs is not None else None, offset)
        return CompletionChoice(
            index=choice.index, text=choice.echo + o.text, logprobs=logprobs, finish_reason=o.finish_reason
        )

    def chunk_item(
        self, choice: Choice, sent: int, delta: str, out: RequestOutput, new: list[TokenLogprob] | None
    ) -> CompletionChoice:
        prompt = self.echoed(choice, out) if sent == 0 else []  # the first chunk carries the echo
        logprobs = self.logprobs(prompt + new if new is not None else None, 0 if prompt else sent)
        return CompletionChoice(
            index=choice.index, text=delta, logprobs=logprobs, finish_reason=out.outputs[0].finish_reason
        )


@dataclass
class ChatFormat(Format):
    whole, streamed = ChatCompletionResponse, ChatCompletionChunk
    token_bytes: Callable[[int], bytes] = field(kw_only=True)  # a token id's raw bytes, as chat's logprobs show them

    def logprobs(self, lps: list[TokenLogprob] | None) -> ChatLogprobs | None:
        if lps is None:
            return None

        def entry(token_id: int, logprob: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(self.token_bytes(token_id))}

        return ChatLogprobs(
            content=[
                ChatTokenLogprob(
                    **entry(lp.token_id, lp.logprob), top_logprobs=[TopLogprob(**entry(*t)) for t in lp.top.items()]
                )
                for lp in lps
            ]
        )

    def opening(self, choices: list[Choice]) -> list[BaseModel]:
        delta = DeltaMessage(role="assistant", content="")
        return [self.streamed(**self.head(), choices=[ChatStreamChoice(index=c.index, delta=delta)]) for c in choices]

    def item(self, choice: Choice, out: RequestOutput) -> ChatChoice:
        o = out.outputs[0]
        message, logprobs = AssistantMessage(content=o.text), self.logprobs(o.logprobs)
        return ChatChoice(index=choice.index, message=message, logprobs=logprobs, finish_reason=o.finish_reason)

    def chunk_item(
        self, choice: Choice, sent: int, delta: str, out: RequestOutput, new: list[TokenLogprob] | None
    ) -> ChatStreamChoice:
        delta_message, reason = DeltaMessage(content=delta), out.outputs[0].finish_reason
        return ChatStreamChoice(
            index=choice.index, delta=delta_message, logprobs=self.logprobs(new), finish_reason=reason
        )


def finished_stats(out: RequestOutput) -> dict:
    """A streamed choice's last chunk carries its speculative statistics."""
    return {"spec_decoding": spec_stats([out])} if out.finished else {}


class OpenAIServing:
    def __init__(self, llm: LLM, engine: AsyncEngine, model_name: str) -> None:
        self.llm, self.engine, self.model_name = llm, engine, model_name
        self.max_model_len = llm.engine.max_model_len
        # a token id's text and raw bytes as logprobs show them, each worked out once per id
        self.token_text = functools.cache(self.own_text)
        self.token_bytes = functools.cache(self.own_bytes)

    async def completion(self, req: CompletionRequest, raw: Request) -> Response:
        self.check(req)
        batch = req.prompts
        if len(batch) * req.n > MAX_CHOICES:  # before the work of tokenizing them
            raise bad_request(f"{len(batch)} prompts x n={req.n} choices is more than {MAX_CHOICES}", "n")
        # tokenizing a long prompt takes a while: off the event loop, which serves every connection
        prompts = await asyncio.to_thread(lambda: [self.prompt(p, req.echo) for p in batch])
        cap_field, cap = req.output_cap()
        max_tokens = cap or COMPLETION_MAX_TOKENS
        for _, ids in prompts:
            self.check_context(len(ids), max_tokens, cap_field or "prompt")
        prompt_logprobs = req.logprobs if req.echo else None  # echo with logprobs: the prompt's too
        choices = [
            Choice(p * req.n + j, p, ids, self.sampling_params(req, max_tokens, j, req.logprobs, prompt_logprobs), echo)
            for p, (echo, ids) in enumerate(prompts)
            for j in range(req.n)
        ]
        fmt = CompletionFormat(f"cmpl-{uuid.uuid4().hex}", self.model_name, self.token_text)
        return await self.generate(req, raw, choices, fmt)

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self.check(req)
        cap_field, cap = req.output_cap()
        ids = await asyncio.to_thread(self.chat_ids, req)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = cap or max(1, self.max_model_len - len(ids))
        self.check_context(len(ids), max_tokens, cap_field or "messages")
        choices = [Choice(j, 0, ids, self.sampling_params(req, max_tokens, j, logprobs)) for j in range(req.n)]
        fmt = ChatFormat(f"chatcmpl-{uuid.uuid4().hex}", self.model_name, self.token_text, token_bytes=self.token_bytes)
        return await self.generate(req, raw, choices, fmt)

    def own_text(self, token_id: int) -> str:
        """A token's own text, as OpenAI's logprobs show it; without a tokenizer, its id."""
        tokenizer = self.llm.tokenizer
        return tokenizer.decode([token_id]) if tokenizer is not None else f"token_id:{token_id}"

    def own_bytes(self, token_id: int) -> bytes:
        """A token's raw bytes (`vocab_bytes`); without a tokenizer, its text's."""
        tokenizer = self.llm.tokenizer
        return vocab_bytes(tokenizer, token_id) if tokenizer is not None else self.token_text(token_id).encode()

    def check(self, req: SamplingRequest) -> None:
        """What pydantic cannot say: fields this server does not take, then the model name."""
        for name, value in (req.model_extra or {}).items():
            if name in IGNORED:
                continue
            if name not in UNSUPPORTED:
                raise bad_request(f"unknown field {name!r}: this server does not take it", name)
            if not feature_off(name, value):
                raise bad_request(f"{name} is not supported by this server", name)
        if req.model != self.model_name:
            raise APIError(
                404,
                f"The model `{req.model}` does not exist (served: `{self.model_name}`)",
                "invalid_request_error",
                "model",
                "model_not_found",
            )

    def chat_ids(self, req: ChatCompletionRequest) -> list[int]:
        try:
            return self.llm.chat_prompt([m.template_message() for m in req.messages])
        except (ValueError, TemplateError) as e:
            raise bad_request(f"the chat template cannot render these messages: {e}", "messages") from e

    def prompt(self, prompt: str | list[int], echo: bool) -> tuple[str, list[int]]:
        try:
            _, ids = self.llm.engine.tokenize(prompt)
        except ValueError as e:
            raise bad_request(str(e), "prompt") from e
        if not ids:
            raise bad_request("the prompt is empty", "prompt")
        if not echo:
            return "", ids
        if isinstance(prompt, str):
            return prompt, ids
        if self.llm.tokenizer is None:
            raise bad_request("echo of a token-id prompt needs a tokenizer, and this model has none", "echo")
        return self.llm.tokenizer.decode(ids), ids

    def check_context(self, prompt_len: int, max_tokens: int, param: str) -> None:
        """A 400 naming `param` (the output's cap the client sent, else the prompt) where the prompt
        and the output do not fit the context."""
        if prompt_len + max_tokens > self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the completion).",
                param,
                "context_length_exceeded",
            )

    def sampling_params(
        self,
        req: SamplingRequest,
        max_tokens: int,
        choice: int,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        try:
            return SamplingParams(
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=req.top_k,
                min_p=req.min_p,
                max_tokens=max_tokens,
                stop=req.stop,
                stop_token_ids=req.stop_token_ids,
                min_tokens=req.min_tokens,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty,
                seed=choice_seed(req.seed, choice),
                ignore_eos=req.ignore_eos,
                include_stop_str_in_output=req.include_stop_str_in_output,
                skip_special_tokens=req.skip_special_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                structured_output=req.structured_output(),
                return_drafts=True,  # the metrics count the drafts each step verified
            )
        except InvalidSamplingParam as e:
            raise bad_request(str(e), e.param) from e

    async def generate(self, req: SamplingRequest, raw: Request, choices: list[Choice], fmt: Format) -> Response:
        grammar = choices[0].params.structured_output
        if grammar is not None:  # compiled here, off the engine's thread, which then finds it compiled
            try:
                await asyncio.to_thread(self.llm.engine.compile_grammar, grammar)
            except InvalidSamplingParam as e:
                raise bad_request(str(e), req.structured_field) from e
        streams = [self.engine.generate(c.prompt_ids, c.params, f"{fmt.id}-{c.index}") for c in choices]
        # Wait for the first outputs before answering, so a request the engine refuses gets a 400.
        try:
            firsts = await unless_disconnected(raw, first_outputs(streams))
        except EngineError as e:
            if e.param == "structured_output":  # the engine's name for it: the request's is one of several
                e.param = req.structured_field
            raise
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            events = self.events(fmt, choices, merged(firsts, streams), include_usage)
            return StreamingResponse(events, media_type="text/event-stream")
        finals = asyncio.gather(*map(final_output, firsts, streams))
        outs = await unless_disconnected(raw, finals)
        body = await asyncio.to_thread(lambda: fmt.response(choices, outs).model_dump_json())  # n x logprobs: large
        return Response(body, media_type="application/json")

    async def events(
        self,
        fmt: Format,
        choices: list[Choice],
        outputs: AsyncIterator[tuple[int, RequestOutput]],
        include_usage: bool,
    ) -> AsyncIterator[str]:
        # Starlette cancels this generator when the client disconnects; closing `outputs` then
        # aborts the choices still running.
        async with aclosing(outputs):
            for chunk in fmt.opening(choices):
                yield sse(chunk)
            sent, reported, last = [""] * len(choices), [0] * len(choices), {}
            try:
                async for i, out in outputs:
                    choice, last[i], logprobs = choices[i], out, out.outputs[0].logprobs
                    text = choice.echo + streamable_text(out.outputs[0].text, out.finished, choice.params.stop)
                    if len(text) > len(sent[i]) or out.finished:
                        new = logprobs[reported[i] :] if logprobs is not None else None
                        yield sse(fmt.chunk(choice, len(sent[i]), text[len(sent[i]) :], out, new))
                        sent[i], reported[i] = text, len(logprobs or [])
            except EngineError as e:
                yield sse(as_api_error(e).body())
            else:
                if include_usage:
                    yield sse(fmt.usage_chunk(usage(choices, last.values())))
            yield "data: [DONE]\n\n"  # also after an error event, as clients wait for it
