"""The OpenAI wire format: request and response models, and the error shape."""

import json
import time
from typing import Annotated, Literal

from fastapi.responses import JSONResponse
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from blockspec.sampling import MAX_LOGPROBS
from blockspec.structured_output import StructuredOutput

# OpenAI's and vLLM's request fields not implemented here: a request that asks for one is a 400
# naming it (`feature_off`: values that ask for nothing pass, as clients send them by default).
# Any other field not declared below is a 400 too: nothing is silently ignored.
UNSUPPORTED = (
    "suffix",
    "logit_bias",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "best_of",
)
IGNORED = ("user",)  # an end-user id for the provider's records: it changes no output


def lone_surrogate(value) -> str | None:
    """The first string in a parsed JSON value that holds a lone UTF-16 surrogate (JSON's "\\ud800"
    escape parses to one; it is no Unicode text, and no tokenizer or UTF-8 encoder takes it). Walked
    without recursion: JSON nests deeper than Python's stack."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str) and any("\ud800" <= c <= "\udfff" for c in item):
            return item
        pending.extend(item.values() if isinstance(item, dict) else item if isinstance(item, list) else ())
    return None


MAX_CHOICES = 64  # n, and prompts x n of a batched completion


def integral_float_as_int(value):
    """JSON's 3.0 is the number 3 (a client's arithmetic may send it); true and "3" stay no integers."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# A request's numbers and switches are strict: a boolean for a number, a number or string for a boolean,
# a numeric string for either is a 400 (StrictFloat takes JSON's 1 too)
Integer = Annotated[StrictInt, BeforeValidator(integral_float_as_int)]


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
        return ASCIIJSONResponse(self.body(), status_code=self.status)


class ASCIIJSONResponse(JSONResponse):
    """JSON with non-ASCII characters escaped: an error message quoting a client's bad text (a lone
    surrogate, which UTF-8 cannot encode) still renders."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


class OpenAIModel(BaseModel):
    # Extra fields are kept, for the request check to name (`OpenAIServing.check`).
    model_config = ConfigDict(extra="allow")

    @field_validator("*", mode="before")
    @classmethod
    def null_is_the_default(cls, value, info: ValidationInfo):
        """An explicit null of an optional field means its default, as OpenAI reads it."""
        field = cls.model_fields[info.field_name]
        return field.get_default(call_default_factory=True) if value is None and not field.is_required() else value

    @field_validator("*", mode="before")
    @classmethod
    def unicode_text(cls, value):
        if lone_surrogate(value) is not None:
            raise ValueError("holds a lone UTF-16 surrogate (such as \\ud800), which is not Unicode text")
        return value


class StreamOptions(OpenAIModel):
    model_config = ConfigDict(extra="forbid")  # a field not named here is a 400
    include_usage: StrictBool = False


class JSONSchema(OpenAIModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")  # None: any JSON object
    strict: StrictBool | None = None  # the schema binds whatever it says: xgrammar's strict mode always


class ResponseFormat(OpenAIModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchema | None = None

    @model_validator(mode="after")
    def schema_with_its_type(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type json_schema, and only then")
        return self

    def structured_output(self) -> StructuredOutput | None:
        if self.type == "text":
            return None
        if self.type == "json_object" or self.json_schema.schema_ is None:
            return StructuredOutput(json_object=True)
        return StructuredOutput(json=self.json_schema.schema_)


class SamplingRequest(OpenAIModel):
    """Fields shared by completions and chat completions (None: the OpenAI default)."""

    model: str
    max_tokens: Integer | None = Field(None, ge=1)
    temperature: StrictFloat | None = Field(None, ge=0)
    top_p: StrictFloat | None = Field(None, gt=0, le=1)
    n: Integer = Field(1, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    seed: Integer | None = Field(None, ge=-(2**63), lt=2**63)  # int64
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: StrictFloat = 0.0
    frequency_penalty: StrictFloat = 0.0
    # vLLM's extensions
    repetition_penalty: StrictFloat = 1.0
    top_k: Integer = Field(0, ge=-1)
    min_p: StrictFloat = Field(0.0, ge=0, le=1)
    ignore_eos: StrictBool = False
    stop_token_ids: list[Integer] | None = Field(None, max_length=256)
    min_tokens: Integer = Field(0, ge=0)
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    response_format: ResponseFormat | None = None
    # vLLM's guided decoding: one of these, or response_format
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("stream_options")
    @classmethod
    def options_of_a_stream(cls, options: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if options is not None and not info.data.get("stream"):
            raise ValueError("only allowed when stream is true")
        return options

    def output_cap(self) -> tuple[str | None, int | None]:
        """The field the client capped the output with, and the cap ((None, None): not capped)."""
        return ("max_tokens", self.max_tokens) if self.max_tokens is not None else (None, None)

    @property
    def structured_field(self) -> str | None:
        """The field that asks for structured output (None: none does); a 400 where two do."""
        fields = ["guided_json", "guided_regex", "guided_choice", "guided_grammar"]
        asked = [name for name in fields if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            asked.insert(0, "response_format")
        if len(asked) > 1:
            raise bad_request(f"{asked[0]} and {asked[1]} both constrain the output: give one", asked[1])
        return asked[0] if asked else None

    def structured_output(self) -> StructuredOutput | None:
        field = self.structured_field
        if field == "response_format":
            return self.response_format.structured_output()
        try:
            return StructuredOutput(**{field.removeprefix("guided_"): getattr(self, field)}) if field else None
        except ValueError as e:  # an empty choice list
            raise bad_request(f"{field}: {e}", field) from e


class CompletionRequest(SamplingRequest):
    # one prompt, or a batch (each its own choices); strict: true is no token id
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    echo: StrictBool = False  # the prompt's text before each choice's
    logprobs: Integer | None = Field(None, ge=0, le=MAX_LOGPROBS)  # each token's, and this many top ones'

    @property
    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or a batch (each its own choices)."""
        batch = isinstance(self.prompt, list) and self.prompt and not isinstance(self.prompt[0], int)
        return self.prompt if batch else [self.prompt]


class TextPart(OpenAIModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str

    @field_validator("type", mode="before")
    @classmethod
    def text_only(cls, value):
        if value != "text":
            raise ValueError(f"content parts of type {value!r} are not supported (text only)")
        return value


TOOL_KEYS = ("tool_calls", "function_call")  # a message's keys of tool use, which this server does not serve
# OpenAI's keys of a message this server does not take: null or empty (a replayed response message
# holds them so) they ask for nothing and pass; else a 400
MESSAGE_KEYS_OFF = (*TOOL_KEYS, "refusal", "audio", "annotations")


class ChatMessage(OpenAIModel):
    model_config = ConfigDict(extra="forbid")  # a key not named here is a 400, not the chat template's to read
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # text, or its parts (text only: this server reads no images or audio); an assistant's may be null
    content: str | list[TextPart] | None
    name: str | None = None  # the author's, for the template
    tool_call_id: str | None = None  # the call a tool message answers

    @model_validator(mode="before")
    @classmethod
    def keys_off(cls, message):
        """MESSAGE_KEYS_OFF that ask for nothing are dropped; tool use is named as such."""
        if not isinstance(message, dict):
            return message
        for key in TOOL_KEYS:
            if message.get(key):
                raise ValueError(f"{key} is not supported: this server takes no tools")
        return {k: v for k, v in message.items() if k not in MESSAGE_KEYS_OFF or v}

    @model_validator(mode="after")
    def fields_of_the_role(self) -> "ChatMessage":
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content is null, which only an assistant message's may be (not a {self.role}'s)")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f"tool_call_id is a tool message's, not a {self.role}'s")
        return self

    def template_message(self) -> dict:
        """The message as the chat template reads it: parts joined by newlines (as vLLM does), a
        developer message as the system message (templates know the older role), `name` and
        `tool_call_id` where given."""
        content = self.content if not isinstance(self.content, list) else "\n".join(p.text for p in self.content)
        role = "system" if self.role == "developer" else self.role
        given = self.model_dump(include={"name", "tool_call_id"}, exclude_none=True)
        return {"role": role, "content": content or ""} | given


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Integer | None = Field(None, ge=1)  # the newer name of max_tokens
    logprobs: StrictBool = False  # each output token's log-probability
    top_logprobs: Integer | None = Field(None, ge=0, le=MAX_LOGPROBS)  # and this many most likely tokens'

    def output_cap(self) -> tuple[str | None, int | None]:
        """max_completion_tokens, or its older name max_tokens: a 400 where both are sent and differ."""
        if self.max_completion_tokens is None:
            return super().output_cap()
        if self.max_tokens not in (None, self.max_completion_tokens):
            raise bad_request(
                f"max_tokens ({self.max_tokens}) differs from max_completion_tokens ({self.max_completion_tokens}), "
                "its newer name: give one, or both the same",
                "max_tokens",
            )
        return "max_completion_tokens", self.max_completion_tokens


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


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # null: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(Envelope):
    """A completion, and also each chunk of a streamed one (OpenAI uses the same object)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
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
    logprobs: ChatLogprobs | None = None
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
