"""The OpenAI-compatible HTTP routes: FastAPI in this process, the engine in another.

Here: auth, the routes, the responses each declares and how each error reaches the client.
Bodies are read in request_body.py and published in /openapi.json by openapi.py.
Tokenization, chat templates and prompt checks are in serving.py; a generation's fan-out
and Deltas in generation.py, its SSE or JSON answer in responses.py. The engine process
owns scheduling, the model and stop strings, and sends deltas (see
nanovllm/engine/engine_proc.py).
"""

import logging
import secrets
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanovllm.core.errors import NanoVLLMError
from nanovllm.engine.chat_output import ChatOutputParser
from nanovllm.engine.tokenizer import Tokenizer
from nanovllm.entrypoints.openai.engine_client import EngineDeadError
from nanovllm.entrypoints.openai.errors import APIError, api_error
from nanovllm.entrypoints.openai.generation import Generation
from nanovllm.entrypoints.openai.openapi import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionResponse,
    DetokenizeResponse,
    ModelList,
    TokenizeResponse,
    json_body,
    publish,
    responses,
)
from nanovllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from nanovllm.entrypoints.openai.replicas import ReplicaSet
from nanovllm.entrypoints.openai.request_body import body_read, read_json
from nanovllm.entrypoints.openai.responses import respond
from nanovllm.entrypoints.openai.serving import Server, ServerSettings
from nanovllm.entrypoints.openai.shapes import ChatShape, CompletionShape

log = logging.getLogger("nanovllm.server")
# declares the key in /openapi.json; check_key does the comparison
_bearer = HTTPBearer(auto_error=False, description="the server's --api-key")


def build_app(client: ReplicaSet, tokenizer: Tokenizer, settings: ServerSettings) -> FastAPI:
    """The FastAPI app serving `client`'s engine; it starts reading the engine's replies
    when the app starts."""
    server = Server(client, tokenizer, settings)
    limit = settings.max_request_bytes

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        client.attach()
        yield
        # a stop's drain timed out: uvicorn cancelled the responses still running, but may
        # end before their cancellation lands; each is aborted and logged here
        for gen in list(server.open):
            gen.close()

    app = FastAPI(title="nano-vLLM", lifespan=lifespan)
    app.state.server = server

    async def check_key(
        request: Request, _: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
    ) -> None:
        given = request.headers.get("authorization", "").encode()
        if not secrets.compare_digest(given, f"Bearer {settings.api_key}".encode()):
            msg = "missing or wrong API key: send 'Authorization: Bearer <key>'"
            raise APIError(401, msg, None, "invalid_api_key")

    # with --api-key: every route that serves the model (/health stays open for probes)
    keyed = [Depends(check_key)] if settings.api_key else []
    auth = (401,) if settings.api_key else ()
    post = (400, *auth, 404, 413, 415)  # any route that reads a body
    v1 = APIRouter(prefix="/v1", dependencies=keyed)

    @app.exception_handler(APIError)
    @app.exception_handler(NanoVLLMError)  # invalid requests, rejections, a dead engine
    async def known_error(request: Request, e: Exception) -> JSONResponse:
        return _error_response(request, api_error(e))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        # Starlette's 405 names the allowed methods in its Allow header
        err = APIError(e.status_code, str(e.detail), headers=dict(e.headers or {}))
        return _error_response(request, err)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        # a bug: Starlette re-raises it after this response, and uvicorn logs the traceback
        log.error("internal error in %s %s: %r", request.method, request.url.path, e)
        return _error_response(request, api_error(e), close=True)

    @app.get("/health", response_class=Response, responses=responses(None, (503,)))
    async def health() -> Response:
        """200 while an engine process runs (no key needed: for probes); with replicas, the
        body names those that are gone."""
        if not client.alive:
            raise EngineDeadError(client.error or "the engine process has exited")
        down = client.down()
        text = "".join(f"replica {i} is down: {why}\n" for i, why in down.items())
        return Response(text, status_code=200, media_type="text/plain")

    metrics_keyed = keyed if settings.protect_metrics else []
    metrics_auth = auth if settings.protect_metrics else ()

    @app.get("/metrics", response_class=PlainTextResponse, dependencies=metrics_keyed,
             responses=responses(None, metrics_auth))
    async def metrics() -> Response:
        """Prometheus text; needs the key only with --protect-metrics."""
        try:
            snapshot = await client.stats() if client.alive else None
        except (EngineDeadError, TimeoutError):
            snapshot = None  # still serve the front end's own metrics
        body = server.metrics.render(snapshot)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @v1.get("/models", response_model=ModelList, responses=responses(ModelList, auth))
    async def models() -> dict:
        card = {"id": server.model_name, "object": "model", "created": server.created}
        card |= {"owned_by": "nanovllm", "max_model_len": server.max_model_len}
        return {"object": "list", "data": [card]}

    @v1.post("/completions", openapi_extra=json_body(CompletionRequest),
             responses=responses(CompletionResponse, (*post, 429, 503), chunk=CompletionChunk))
    async def completions(request: Request) -> Response:
        req = await read_json(request, CompletionRequest, limit)
        server.check_model(req.model)
        params = server.sampling_params(req)
        special = req.parse_special_tokens
        prompts = [server.prompt_ids(p, params.max_tokens, special) for p in req.prompts()]
        gen = Generation(server, "cmpl", req, params, prompts)
        return await respond(request, gen, CompletionShape(req, server.token_str))

    @v1.post("/chat/completions", openapi_extra=json_body(ChatCompletionRequest),
             responses=responses(ChatCompletionResponse, (*post, 429, 503),
                                 chunk=ChatCompletionChunk))
    async def chat_completions(request: Request) -> Response:
        req = await read_json(request, ChatCompletionRequest, limit)
        server.check_model(req.model)
        tools = server.chat_tools(req)
        params = server.sampling_params(req, tools)
        ids = server.chat_ids(req, params.max_tokens, tools)
        gen = Generation(server, "chatcmpl", req, params, [ids])
        parser = ChatOutputParser(server.reasoning_parser, tools)
        return await respond(request, gen, ChatShape(req, server.token_str, parser))

    @app.post("/tokenize", dependencies=keyed, openapi_extra=json_body(TokenizeRequest),
              response_model=TokenizeResponse, responses=responses(TokenizeResponse, post))
    async def tokenize(request: Request) -> dict:
        req = await read_json(request, TokenizeRequest, limit)
        server.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt")
        if req.messages is not None:
            ids = server.render_chat(req)
        else:
            ids = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens,
                                   parse_special_tokens=req.parse_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": server.max_model_len}

    @app.post("/detokenize", dependencies=keyed, openapi_extra=json_body(DetokenizeRequest),
              response_model=DetokenizeResponse, responses=responses(DetokenizeResponse, post))
    async def detokenize(request: Request) -> dict:
        req = await read_json(request, DetokenizeRequest, limit)
        server.check_model(req.model)
        return {"prompt": server.decode(req.tokens)}

    app.include_router(v1)
    publish(app, [CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest])
    return app


def _error_response(request: Request, err: APIError, close: bool = False) -> JSONResponse:
    """`err` as OpenAI's error body. `Connection: close` when the connection cannot serve
    another request as it is: a bug (`close`), or a body left unread, which would otherwise
    be drained whatever its size."""
    headers = dict(err.headers or {})
    has_body = request.headers.get("content-length", "0") != "0" or (
        "transfer-encoding" in request.headers
    )
    if close or (has_body and not body_read(request)):
        headers["Connection"] = "close"
    return JSONResponse(err.body(), status_code=err.status, headers=headers)
