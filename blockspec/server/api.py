"""The FastAPI app: routes, API-key check, OpenAI-style errors, and `serve` for `blockspec serve`."""

import re
import secrets
from contextlib import asynccontextmanager

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from blockspec.llm import LLM
from blockspec.server.async_engine import AsyncEngine, EngineError
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


def api_key_check(api_key: str | None):
    """A dependency that wants `Authorization: Bearer <api_key>` (nothing when no key is set)."""

    async def check(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.encode(), api_key.encode()):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")

    return check


def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    """Pydantic's first complaint, as a 400 naming the offending top-level parameter (the message
    has its path inside it, without pydantic's union branch tags such as `str` or `list[int]`)."""
    err = exc.errors()[0]
    if err["type"] == "json_invalid":  # its location is a character offset, not a parameter
        return bad_request(f"the request body is not valid JSON ({err['msg']})").response()
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


def build_app(llm: LLM, model_name: str, api_key: str | None = None) -> FastAPI:
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
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(api_key_check(api_key))])

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


def serve(llm: LLM, model_name: str, host: str, port: int, api_key: str | None = None) -> None:
    """Serve `llm` as `model_name` on host:port until interrupted."""
    uvicorn.run(build_app(llm, model_name, api_key), host=host, port=port)
