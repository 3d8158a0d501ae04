"""OpenAI requests in, engine requests out; engine outputs back as OpenAI responses, whole
or as server-sent events."""

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from jinja2 import TemplateError
from pydantic import BaseModel

from blockspec.engine.detokenizer import streamable_text
from blockspec.llm import LLM
from blockspec.outputs import RequestOutput
from blockspec.sampling import InvalidSamplingParam, SamplingParams
from blockspec.server.async_engine import AsyncEngine, EngineError
from blockspec.server.protocol import (
    UNSUPPORTED,
    APIError,
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatStreamChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    SamplingRequest,
    SpecDecodingStats,
    UsageInfo,
    bad_request,
)

T = TypeVar("T")
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context


def usage(out: RequestOutput) -> UsageInfo:
    prompt, completion = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def spec_stats(out: RequestOutput) -> SpecDecodingStats:
    lengths = out.metrics.acceptance_lengths
    return SpecDecodingStats(
        acceptance_lengths=lengths,
        mean_acceptance_length=out.metrics.mean_acceptance_length,
        num_steps=len(lengths),
        num_draft_tokens=sum(len(d) for d in out.metrics.draft_token_ids or []),
        num_accepted_tokens=sum(lengths) - len(lengths),  # every step commits one bonus token
    )


def sse(chunk: BaseModel | dict) -> str:
    data = chunk.model_dump_json() if isinstance(chunk, BaseModel) else json.dumps(chunk)
    return f"data: {data}\n\n"


async def prepend(first: T, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    yield first
    async for item in rest:
        yield item


async def final_output(first: RequestOutput, outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    out = first
    async for out in outputs:  # the last one is the answer
        pass
    return out


def feature_off(name: str, value) -> bool:
    """Whether an unsupported field asks for nothing: null, false, 0, "", [] or {} (clients send
    frequency_penalty 0, logit_bias {}), best_of 1; but logprobs 0 asks for the sampled tokens'."""
    if name == "logprobs":
        return value is None or value is False
    return not value or (name == "best_of" and value == 1)


def as_api_error(e: EngineError) -> APIError:
    return bad_request(str(e)) if e.bad_request else APIError(500, str(e), "server_error")


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
    """Builds one request's response objects; subclasses give the endpoint's shapes."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    def head(self) -> dict:
        return {"id": self.id, "model": self.model, "created": self.created}

    def tail(self, out: RequestOutput) -> dict:
        """The finished request's extras: speculative stats (usage goes in its own chunk)."""
        return {"spec_decoding": spec_stats(out)} if out.finished else {}

    def opening(self) -> list[BaseModel]:
        return []


class CompletionFormat(Format):
    def chunk(self, delta: str, out: RequestOutput) -> BaseModel:
        choice = CompletionChoice(text=delta, finish_reason=out.outputs[0].finish_reason)
        return CompletionResponse(**self.head(), choices=[choice], **self.tail(out))

    def response(self, out: RequestOutput) -> BaseModel:
        choice = CompletionChoice(text=out.outputs[0].text, finish_reason=out.outputs[0].finish_reason)
        return CompletionResponse(**self.head(), choices=[choice], usage=usage(out), **self.tail(out))

    def usage_chunk(self, out: RequestOutput) -> BaseModel:
        return CompletionResponse(**self.head(), choices=[], usage=usage(out))


class ChatFormat(Format):
    def opening(self) -> list[BaseModel]:
        choice = ChatStreamChoice(delta=DeltaMessage(role="assistant", content=""))
        return [ChatCompletionChunk(**self.head(), choices=[choice])]

    def chunk(self, delta: str, out: RequestOutput) -> BaseModel:
        choice = ChatStreamChoice(delta=DeltaMessage(content=delta), finish_reason=out.outputs[0].finish_reason)
        return ChatCompletionChunk(**self.head(), choices=[choice], **self.tail(out))

    def response(self, out: RequestOutput) -> BaseModel:
        message = AssistantMessage(content=out.outputs[0].text)
        choice = ChatChoice(message=message, finish_reason=out.outputs[0].finish_reason)
        return ChatCompletionResponse(**self.head(), choices=[choice], usage=usage(out), **self.tail(out))

    def usage_chunk(self, out: RequestOutput) -> BaseModel:
        return ChatCompletionChunk(**self.head(), choices=[], usage=usage(out))


class OpenAIServing:
    def __init__(self, llm: LLM, engine: AsyncEngine, model_name: str) -> None:
        self.llm, self.engine, self.model_name = llm, engine, model_name
        self.max_model_len = llm.engine.max_model_len

    async def completion(self, req: CompletionRequest, raw: Request) -> Response:
        self.check(req)
        ids = self.prompt_ids(req.prompt)
        fmt = CompletionFormat(f"cmpl-{uuid.uuid4().hex}", self.model_name)
        return await self.generate(req, raw, ids, req.max_tokens or COMPLETION_MAX_TOKENS, fmt)

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self.check(req)
        try:
            ids = self.llm.chat_prompt([{"role": m.role, "content": m.content} for m in req.messages])
        except (ValueError, TemplateError) as e:
            raise bad_request(f"the chat template cannot render these messages: {e}", "messages") from e
        max_tokens = req.max_completion_tokens or req.max_tokens or max(1, self.max_model_len - len(ids))
        fmt = ChatFormat(f"chatcmpl-{uuid.uuid4().hex}", self.model_name)
        return await self.generate(req, raw, ids, max_tokens, fmt)

    def check(self, req: SamplingRequest) -> None:
        """What pydantic cannot say: unsupported features, then the model name."""
        if req.n not in (None, 1):
            raise bad_request(f"n={req.n} is not supported: one choice per request (send n requests)", "n")
        for name, value in (req.model_extra or {}).items():
            if name in UNSUPPORTED and not feature_off(name, value):
                raise bad_request(f"{name} is not supported by this server", name)
        if req.model != self.model_name:
            raise APIError(
                404,
                f"The model `{req.model}` does not exist (served: `{self.model_name}`)",
                "invalid_request_error",
                "model",
                "model_not_found",
            )

    def prompt_ids(self, prompt: str | list) -> list[int]:
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise bad_request("batched prompts are not supported: send one prompt per request", "prompt")
            prompt = prompt[0]
        try:
            return self.llm.engine.tokenize(prompt)[1]
        except ValueError as e:
            raise bad_request(str(e), "prompt") from e

    def sampling_params(self, req: SamplingRequest, prompt_len: int, max_tokens: int) -> SamplingParams:
        if prompt_len + max_tokens > self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the completion).",
                "max_tokens",
                "context_length_exceeded",
            )
        try:
            return SamplingParams(
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=req.top_k,
                min_p=req.min_p,
                max_tokens=max_tokens,
                stop=req.stop,
                seed=req.seed,
                ignore_eos=req.ignore_eos,
                return_drafts=True,  # the metrics count the drafts each step verified
            )
        except InvalidSamplingParam as e:
            raise bad_request(str(e), e.param) from e

    async def generate(
        self, req: SamplingRequest, raw: Request, ids: list[int], max_tokens: int, fmt: Format
    ) -> Response:
        params = self.sampling_params(req, len(ids), max_tokens)
        outputs = self.engine.generate(ids, params, fmt.id)
        # Wait for the first output before answering, so a request the engine refuses gets a 400.
        first = await unless_disconnected(raw, anext(outputs))
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            events = self.events(fmt, first, outputs, params.stop, include_usage)
            return StreamingResponse(events, media_type="text/event-stream")
        return Response(
            fmt.response(await unless_disconnected(raw, final_output(first, outputs))).model_dump_json(),
            media_type="application/json",
        )

    async def events(
        self,
        fmt: Format,
        first: RequestOutput,
        outputs: AsyncIterator[RequestOutput],
        stop: list[str],
        include_usage: bool,
    ) -> AsyncIterator[str]:
        # Starlette cancels this generator when the client disconnects; closing `outputs` then
        # aborts the request.
        async with aclosing(outputs):
            for chunk in fmt.opening():
                yield sse(chunk)
            sent = ""
            try:
                async for out in prepend(first, outputs):
                    text = streamable_text(out.outputs[0].text, out.finished, stop)
                    if len(text) > len(sent) or out.finished:
                        yield sse(fmt.chunk(text[len(sent) :], out))
                        sent = text
            except EngineError as e:
                yield sse(as_api_error(e).body())
            else:
                if include_usage:
                    yield sse(fmt.usage_chunk(out))
            yield "data: [DONE]\n\n"  # also after an error event, as clients wait for it
