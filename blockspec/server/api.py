"""The FastAPI app: routes, the gate every /v1 request passes before its body is read (API key,
body size and arrival time), OpenAI-style errors, and `serve` for `blockspec serve`."""

import asyncio
import re
import secrets
from contextlib import asynccontextmanager

import uvicorn
from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from blockspec.llm import LLM
from blockspec.server.async_engine import AsyncEngine, EngineError
from blockspec.server.http import HeadTimeoutProtocol
from blockspec.server.metrics import ServerMetrics
from blockspec.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    bad_request,
)
from blockspec.server.serving import OpenAIServing, as_api_error

UNION_TAG = re.compile(r"str|int|float|bool|list\[.*\]")  # pydantic's name for a union's branch


MAX_BODY_BYTES = 32 * 2**20  # a request body past it is a 413 (prompts of 10^6 tokens still fit)
BODY_TIMEOUT_S = 60.0  # a body not all arrived by then is a 408


def authorized(headers: Headers, api_key: str | None) -> bool:
    """`Authorization: Bearer <api_key>` (anything when no key is set)."""
    if api_key is None:
        return True
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), api_key.encode())


def closing(error: APIError) -> JSONResponse:
    """An answer sent before the body is read, closing the connection: the unread body is not
    taken for the next request, nor read to its end."""
    response = error.response()
    response.headers["connection"] = "close"
    return response


OPEN_PATHS = ("/health", "/metrics")  # all else is behind the gate, wherever the app is mounted


class RequestGate:
    """ASGI middleware for every route but `OPEN_PATHS`: the API key is checked before the body is
    read (a wrong key costs the server no parsing, however large the body), then the body must stay
    within `max_body_bytes` (its declared length, and what arrives) and arrive within
    `body_timeout_s`."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int, body_timeout_s: float) -> None:
        self.app, self.api_key = app, api_key
        self.max_body_bytes, self.body_timeout_s = max_body_bytes, body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].endswith(OPEN_PATHS):
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        if not authorized(headers, self.api_key):
            error = APIError(401, "Incorrect API key provided.", code="invalid_api_key")
            return await closing(error)(scope, receive, send)
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return await closing(self.too_large())(scope, receive, send)
        return await self.app(scope, self.limited(receive), send)

    def too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than {self.max_body_bytes} bytes", code="body_too_large")

    def limited(self, receive: Receive) -> Receive:
        """`receive`, failing the body's reader (FastAPI answers its HTTPException) once the body
        grows past the limit or is late; after the body, passed through (a handler waits on it
        for the client's disconnect)."""
        loop = asyncio.get_running_loop()
        deadline, size, done = loop.time() + self.body_timeout_s, 0, False

        async def receive_body() -> Message:
            nonlocal size, done
            if done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
                raise HTTPException(408, f"the request body did not arrive within {self.body_timeout_s:g} s") from None
            size += len(message.get("body", b""))
            done = message["type"] != "http.request" or not message.get("more_body", False)
            if size > self.max_body_bytes:
                raise HTTPException(413, self.too_large().message)
            return message

        return receive_body


async def server_error(_: Request, exc: Exception) -> JSONResponse:
    """An unexpected failure: OpenAI's error JSON, not a bare text page (the traceback is logged)."""
    return APIError(500, f"internal error: {type(exc).__name__}", "server_error").response()


def most_specific(errors: list[dict]) -> dict:
    """Pydantic's first complaint; where it is of a union, the branch that got deepest (a list of
    content parts failing inside, rather than the string it is not either)."""
    loc = errors[0]["loc"]
    union = next((i for i, p in enumerate(loc) if UNION_TAG.fullmatch(str(p))), len(loc))
    return max((e for e in errors if e["loc"][:union] == loc[:union]), key=lambda e: len(e["loc"]))


def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    """Pydantic's most specific complaint, as a 400 naming the offending top-level parameter (the
    message has its path inside it, without pydantic's union branch tags such as `str` or `list[int]`)."""
    err = most_specific(exc.errors())
    if err["type"] == "json_invalid":  # its location is a character offset, not a parameter
        return bad_request(f"the request body is not valid JSON ({err['msg']})").response()
    if err["type"] == "missing" and tuple(err["loc"]) == ("body",):
        return bad_request("the request body is empty: send a JSON object of the request's fields").response()
    loc = [str(p) for p in err["loc"] if p != "body"]
    path = ".".join(p for p in loc if not UNION_TAG.fullmatch(p))
    message = str(err["ctx"]["error"]) if err["type"] == "value_error" else err["msg"]
    return bad_request(f"{path}: {message}" if path else message, loc[0] if loc else None).response()


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, lambda _, e: e.response())
    app.add_exception_handler(EngineError, lambda _, e: as_api_error(e).response())
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(
        HTTPException, lambda _, e: APIError(e.status_code, str(e.detail), "invalid_request_error").response()
    )
    app.add_exception_handler(Exception, server_error)


def build_app(
    llm: LLM,
    model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    body_timeout_s: float = BODY_TIMEOUT_S,
) -> FastAPI:
    metrics = ServerMetrics(llm.engine)
    engine = AsyncEngine(llm.engine, metrics)
    serving = OpenAIServing(llm, engine, model_name)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="blockspec", lifespan=lifespan)
    add_error_handlers(app)
    app.add_middleware(RequestGate, api_key=api_key, max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s)
    v1 = APIRouter(prefix="/v1")

    @v1.get("/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, max_model_len=serving.max_model_len)])

    @v1.post("/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await serving.completion(req, raw)

    @v1.post("/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await serving.chat(req, raw)

    @app.get("/health")
    async def health() -> Response:
        if not engine.alive:
            return APIError(503, "the engine loop has stopped", "server_error").response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.include_router(v1)
    return app


def serve(
    llm: LLM, model_name: str, host: str, port: int, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES
) -> None:
    """Serve `llm` as `model_name` on host:port until interrupted."""
    uvicorn.run(build_app(llm, model_name, api_key, max_body_bytes), host=host, port=port, http=HeadTimeoutProtocol)
