"""The OpenAI wire format: request and response models, and the error shape."""

import time
from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

# Accepted by OpenAI but not implemented here: rejected with 400 rather than silently ignored.
UNSUPPORTED = (
    "logprobs",
    "top_logprobs",
    "echo",
    "suffix",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "tools",
    "functions",
    "best_of",
)


class APIError(Exception):
    """An error answered with OpenAI's JSON: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are ignored, as OpenAI does


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class SamplingRequest(OpenAIModel):
    """Fields shared by completions and chat completions (None: the OpenAI default)."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    top_k: int = Field(0, ge=-1)  # vLLM's extensions, like ignore_eos
    min_p: float = Field(0.0, ge=0, le=1)
    ignore_eos: bool = False

    @field_validator("max_tokens", "temperature", "top_p", "n", "seed", "top_k", "min_p", mode="before")
    @classmethod
    def no_booleans(cls, value):  # pydantic's lax mode would read true as 1 (3.0 as 3 may pass)
        if isinstance(value, bool):
            raise ValueError("a number is expected, not a boolean")  # noqa: TRY004 (pydantic reports ValueErrors)
        return value


class CompletionRequest(SamplingRequest):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]  # strict: true is no token id


class ChatMessage(OpenAIModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SpecDecodingStats(BaseModel):
    """This request's speculative decoding: tokens committed per step (accepted drafts + bonus)."""

    acceptance_lengths: list[int]
    mean_acceptance_length: float
    num_steps: int
    num_draft_tokens: int
    num_accepted_tokens: int


class Envelope(BaseModel):
    id: str
    created: int
    model: str
    usage: UsageInfo | None = None
    spec_decoding: SpecDecodingStats | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class CompletionResponse(Envelope):
    """A completion, and also each chunk of a streamed one (OpenAI uses the same object)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None = None


class ChatCompletionResponse(Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    finish_reason: str | None = None


class ChatCompletionChunk(Envelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "blockspec"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
