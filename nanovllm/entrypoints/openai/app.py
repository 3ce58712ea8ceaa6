"""The OpenAI-compatible HTTP routes: FastAPI in this process, the engine in another.

Here: auth, body limits, the routes and how each error reaches the client. Tokenization,
chat templates and prompt checks are in serving.py; a generation's fan-out and Deltas in
generation.py, its SSE or JSON answer in responses.py. The engine process owns scheduling,
the model and stop strings, and sends deltas (see nanovllm/engine/engine_proc.py).
"""

import json
import logging
import secrets
from contextlib import asynccontextmanager
from typing import TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanovllm.core.errors import NanoVLLMError
from nanovllm.engine.tokenizer import Tokenizer
from nanovllm.entrypoints.openai.engine_client import EngineClient, EngineDeadError
from nanovllm.entrypoints.openai.errors import APIError, api_error
from nanovllm.entrypoints.openai.generation import Generation
from nanovllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatShape,
    CompletionRequest,
    CompletionShape,
    DetokenizeRequest,
    TokenizeRequest,
)
from nanovllm.entrypoints.openai.responses import respond
from nanovllm.entrypoints.openai.serving import Server, ServerConfig

log = logging.getLogger("nanovllm.server")
T = TypeVar("T", bound=BaseModel)


def build_app(client: EngineClient, tokenizer: Tokenizer, config: ServerConfig) -> FastAPI:
    """The FastAPI app serving `client`'s engine; it starts reading the engine's replies
    when the app starts."""
    server = Server(client, tokenizer, config)
    limit = config.max_request_bytes

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        client.attach()
        yield

    app = FastAPI(title="nano-vLLM", lifespan=lifespan)
    app.state.server = server

    async def check_key(request: Request) -> None:
        if config.api_key is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not secrets.compare_digest(given, f"Bearer {config.api_key}".encode()):
            msg = "missing or wrong API key: send 'Authorization: Bearer <key>'"
            raise APIError(401, msg, None, "invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])

    @app.exception_handler(APIError)
    @app.exception_handler(NanoVLLMError)  # invalid requests, rejections, a dead engine
    async def known_error(request: Request, e: Exception) -> JSONResponse:
        err = api_error(e)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return await known_error(request, APIError(e.status_code, str(e.detail)))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        # Starlette re-raises it after this response, and uvicorn logs the traceback
        log.error("internal error in %s %s: %r", request.method, request.url.path, e)
        return await known_error(request, e)

    @app.get("/health")
    async def health() -> Response:
        if not client.alive:
            raise EngineDeadError(client.error or "the engine process has exited")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            snapshot = await client.stats() if client.alive else None
        except (EngineDeadError, TimeoutError):
            snapshot = None  # still serve the front end's own metrics
        body = server.metrics.render(snapshot)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @v1.get("/models")
    async def models() -> dict:
        card = {"id": server.model_name, "object": "model", "created": server.created}
        card |= {"owned_by": "nanovllm", "max_model_len": server.max_model_len}
        return {"object": "list", "data": [card]}

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        req = await _read_json(request, CompletionRequest, limit)
        server.check_model(req.model)
        params = server.sampling_params(req)
        prompts = [server.prompt_ids(p, params.max_tokens) for p in req.prompts()]
        gen = Generation(server, "cmpl", req, params, prompts)
        return await respond(request, gen, CompletionShape(req, server.token_str))

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await _read_json(request, ChatCompletionRequest, limit)
        server.check_model(req.model)
        params = server.sampling_params(req)
        ids = server.chat_ids(req, params.max_tokens)
        gen = Generation(server, "chatcmpl", req, params, [ids])
        return await respond(request, gen, ChatShape(req, server.token_str))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        req = await _read_json(request, TokenizeRequest, limit)
        server.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt")
        if req.messages is not None:
            ids = server.render_chat(req)
        else:
            ids = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": server.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        req = await _read_json(request, DetokenizeRequest, limit)
        server.check_model(req.model)
        return {"prompt": server.decode(req.tokens)}

    app.include_router(v1)
    return app


async def _read_json(request: Request, model: type[T], limit: int) -> T:
    """The body as `model`: 413 past `limit` bytes (declared or sent), 400 if malformed."""
    too_large = APIError(
        413, f"the request body is larger than the limit of {limit} bytes", None, "too_large"
    )
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > limit:
            raise too_large
    try:
        data = json.loads(body)
    except ValueError as e:
        raise APIError(400, f"the body is not valid JSON: {e}", None, "invalid_json") from e
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object", None, "invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise APIError.from_validation(e) from e
