"""The OpenAI-compatible HTTP server: FastAPI routes in this process, the engine in another.

Here: auth, body limits, tokenization and chat templates, validation, SSE, metrics, and the
detokenization of streams without stop strings. The engine process owns scheduling, the
model and stop strings, and sends deltas (see nanovllm/engine/engine_proc.py).
"""

import asyncio
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanovllm.core.errors import InvalidRequestError
from nanovllm.core.sampling_params import SamplingParams
from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.engine.engine_proc import AddRequest, Delta
from nanovllm.engine.tokenizer import Tokenizer
from nanovllm.entrypoints.openai.engine_client import EngineClient, EngineDeadError
from nanovllm.entrypoints.openai.metrics import Metrics
from nanovllm.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatShape,
    CompletionRequest,
    CompletionShape,
    DetokenizeRequest,
    ResponseShape,
    TokenizeRequest,
    flatten_messages,
)

log = logging.getLogger("nanovllm.server")
T = TypeVar("T", bound=BaseModel)
GenerateRequest = CompletionRequest | ChatCompletionRequest
MAX_N = 16  # completions per request, also capped by max_num_seqs


@dataclass
class ServerConfig:
    served_model_name: str
    api_key: str | None = None
    max_request_bytes: int = 1 << 20
    max_n: int = MAX_N


class Server:
    """What the routes share: the engine client, the tokenizer, limits and metrics."""

    def __init__(self, client: EngineClient, tokenizer: Tokenizer, config: ServerConfig) -> None:
        self.client, self.tokenizer, self.config = client, tokenizer, config
        self.model_name = config.served_model_name
        self.max_model_len: int = client.info["max_model_len"]
        self.vocab_size: int = client.info["vocab_size"]
        self.metrics = Metrics(self.model_name)
        self.created = int(time.time())

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            msg = f"model {model!r} does not exist; this server serves {self.model_name!r}"
            raise APIError(404, msg, "model", "model_not_found")

    def check_tokens(self, ids: list[int], param: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            msg = f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
            raise InvalidRequestError(msg, param)

    def encode(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt, checked as LLMEngine.tokenize_prompt checks them."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.check_tokens(ids, "prompt")
        if not ids:
            raise InvalidRequestError("the prompt is empty; give at least one token", "prompt")
        return ids

    def render_chat(self, req: ChatCompletionRequest | TokenizeRequest) -> list[int]:
        """As LLMEngine.render_chat: the template writes any BOS itself."""
        kwargs = getattr(req, "chat_template_kwargs", None) or {}
        messages = flatten_messages(req.messages)
        text = self.tokenizer.apply_chat_template(messages, req.add_generation_prompt, **kwargs)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def sampling_params(self, req: GenerateRequest) -> SamplingParams:
        params = req.sampling_params()
        if params.n > self.config.max_n:
            msg = f"n={params.n} is too large; use at most {self.config.max_n}"
            raise APIError(400, msg, "n", "invalid_value")
        return params

    def check_length(self, ids: list[int], max_tokens: int | None, param: str) -> None:
        limit, n = self.max_model_len, len(ids)
        if n >= limit:
            msg = (
                f"the prompt has {n} tokens but max_model_len is {limit}, leaving no room to "
                f"generate; shorten the prompt to at most {limit - 1} tokens"
            )
            raise APIError(400, msg, param, "context_length_exceeded")
        if max_tokens is not None and n + max_tokens > limit:
            msg = (
                f"the prompt has {n} tokens and max_tokens is {max_tokens}, together more than "
                f"max_model_len {limit}; lower max_tokens to at most {limit - n} or shorten "
                "the prompt"
            )
            raise APIError(400, msg, "max_tokens", "context_length_exceeded")

    @lru_cache(maxsize=1 << 16)  # noqa: B019 (one Server per process)
    def token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


# ---- one HTTP request as engine requests ------------------------------------------------


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[int, dict[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    first_token_time: float | None = None
    detok: IncrementalDetokenizer | None = None  # streams the engine does not decode


@dataclass
class _Sub:
    """One engine request: one prompt, n completions."""

    request_id: str
    prompt_index: int
    num_prompt_tokens: int
    left: int  # completions not finished
    sent: bool = False  # handed to the engine pipe
    added: bool = False  # accepted by the engine
    num_cached_tokens: int = 0
    first_token_time: float | None = None
    queue_time: float | None = None


class Generation:
    """An HTTP request's prompts as engine requests, merged into one stream of choices.
    Choice index = prompt index * n + completion index, as OpenAI numbers them."""

    def __init__(
        self, server: Server, prefix: str, prompts: list[list[int]], req: GenerateRequest
    ) -> None:
        self.server, self.req, self.prompts = server, req, prompts
        self.params = server.sampling_params(req)
        self.n = self.params.n
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.arrival = time.monotonic()
        self.subs = {
            f"{self.id}-{i}": _Sub(f"{self.id}-{i}", i, len(ids), self.n)
            for i, ids in enumerate(prompts)
        }
        self.choices = [_Choice() for _ in range(len(prompts) * self.n)]
        # A stream without stop strings is decoded here, off the engine's critical path (the
        # engine decodes what has stop strings, to end the sequence in the step that made one)
        self.detokenize = not req.stream or bool(self.params.stop_list)
        if not self.detokenize:
            skip = self.params.skip_special_tokens
            for c in self.choices:
                c.detok = IncrementalDetokenizer(server.tokenizer, skip)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.closed = False

    async def start(self) -> None:
        """Add every prompt to the engine; on a rejection, abort those already added."""
        r = self.req
        try:
            for sub, ids in zip(self.subs.values(), self.prompts):
                # not streamed: the engine sends one Delta per completion, at its end
                add = AddRequest(sub.request_id, ids, self.params, r.priority, r.timeout,
                                 r.stream, self.detokenize)
                sub.sent = True  # from here the engine may hold it, even if we are cancelled
                await self.server.client.add(add, self.queue)
                sub.added = True
        except BaseException:
            self.close()
            raise

    async def delta_batches(self) -> AsyncIterator[list[tuple[int, Delta]]]:
        """[(choice index, Delta)] until every completion has finished. Everything already
        queued is taken at once and merged per choice, so a client that falls behind the
        engine gets fewer, larger chunks instead of a growing backlog of tiny ones."""
        left = len(self.choices)
        while left:
            items = [await self.queue.get()]
            while not self.queue.empty():
                items.append(self.queue.get_nowait())
            merged: dict[int, Delta] = {}
            for d in items:
                if isinstance(d, Exception):
                    raise d
                sub = self.subs[d.request_id]
                i = sub.prompt_index * self.n + d.index
                choice = self.choices[i]
                if choice.detok is not None:
                    d.text = choice.detok.step(d.token_ids)
                    if d.finish_reason is not None:
                        d.text += choice.detok.flush()
                self._observe(sub, choice, d)
                left -= d.finish_reason is not None
                merged[i] = merged[i].merge(d) if i in merged else d
            yield list(merged.items())

    async def collect(self) -> None:
        async for _ in self.delta_batches():
            pass

    def _observe(self, sub: _Sub, choice: _Choice, d: Delta) -> None:
        now, m, stream = time.monotonic(), self.server.metrics, self.req.stream
        choice.token_ids += d.token_ids
        if not stream:  # the whole text is answered at the end; a stream has sent its pieces
            choice.text.append(d.text)
            if d.logprobs:
                choice.logprobs += zip(d.token_ids, d.logprobs)
        sub.num_cached_tokens = max(sub.num_cached_tokens, d.num_cached_tokens)
        if sub.queue_time is None and d.queue_time is not None:
            sub.queue_time = d.queue_time
            m.queue_time.observe(d.queue_time)
        if d.token_ids and choice.first_token_time is None:
            choice.first_token_time = now
            if sub.first_token_time is None and stream:  # unknown when not streamed
                sub.first_token_time = now
                m.ttft.observe(now - self.arrival)
        if d.finish_reason is None:
            return
        choice.finish_reason, choice.stop_reason = d.finish_reason, d.stop_reason
        if stream and len(choice.token_ids) > 1:
            m.tpot.observe((now - choice.first_token_time) / (len(choice.token_ids) - 1))
        sub.left -= 1
        if sub.left == 0:
            m.e2e.observe(now - self.arrival)
            self._log(sub)

    def _log(self, sub: _Sub) -> None:
        mine = self.choices[sub.prompt_index * self.n : (sub.prompt_index + 1) * self.n]
        reasons = ",".join(sorted({c.finish_reason or "abort" for c in mine}))
        ttft = f"{sub.first_token_time - self.arrival:.3f}s" if sub.first_token_time else "-"
        log.info(
            "%s: prompt %d tokens (%d cached), completion %d tokens, TTFT %s, total %.3fs, %s",
            sub.request_id,
            sub.num_prompt_tokens,
            sub.num_cached_tokens,
            sum(len(c.token_ids) for c in mine),
            ttft,
            time.monotonic() - self.arrival,
            reasons,
        )

    def close(self) -> None:
        """Abort what has not finished (the client left, or an error); idempotent."""
        if self.closed:
            return
        self.closed = True
        for sub in self.subs.values():
            unfinished = sub.sent and sub.left > 0
            # an abort queued behind its own add (the pipe keeps order) ends it even when the
            # client left before the engine accepted it; the engine ignores unknown ids
            self.server.client.release(sub.request_id, abort=unfinished)
            if unfinished and sub.added:
                self._log(sub)

    def usage(self) -> dict[str, Any]:
        prompt = sum(s.num_prompt_tokens for s in self.subs.values())
        completion = sum(len(c.token_ids) for c in self.choices)
        cached = sum(s.num_cached_tokens for s in self.subs.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def header(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.server.model_name,
        }


# ---- serving one generation request -----------------------------------------------------


async def _generate(request: Request, gen: Generation, shape: ResponseShape) -> Response:
    await gen.start()
    if gen.req.stream:
        # the background task also runs when the client leaves before the first chunk
        events = _sse_events(gen, shape)
        close = BackgroundTask(gen.close)
        return StreamingResponse(events, media_type="text/event-stream", background=close)
    collect = asyncio.ensure_future(gen.collect())
    gone = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        collect.cancel()  # no-op once done
        gen.close()  # aborts what the client no longer waits for
    if collect.cancelled():
        return Response(status_code=499)  # the client has gone
    collect.result()  # raises what collecting raised
    choices = [
        shape.choice(i, "".join(c.text), c.logprobs, c.finish_reason, c.stop_reason)
        for i, c in enumerate(gen.choices)
    ]
    return JSONResponse({**gen.header(shape.obj), "choices": choices, "usage": gen.usage()})


async def _sse_events(gen: Generation, shape: ResponseShape) -> AsyncIterator[str]:
    usage = gen.req.include_usage

    header = gen.header(shape.chunk_obj)  # the same id, time and model in every chunk

    def event(choices: list[dict], usage_: dict | None = None) -> str:
        data = {**header, "choices": choices}
        if usage:  # OpenAI: null in every chunk but the last
            data["usage"] = usage_
        return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"

    try:
        for choice in shape.opening(len(gen.choices)):
            yield event([choice])
        async for batch in gen.delta_batches():
            events = []
            for i, d in batch:
                if d.text or d.logprobs or d.finish_reason:  # not a character still incomplete
                    entries = list(zip(d.token_ids, d.logprobs or ()))
                    args = (i, d.text, entries, d.finish_reason, d.stop_reason)
                    events.append(event([shape.choice(*args, delta=True)]))
            if events:
                yield "".join(events)  # one write for the whole batch
        if usage:
            yield event([], gen.usage())
    except Exception as e:  # the response has started: report the error in the stream
        err = e if isinstance(e, APIError) else _server_error(e)
        if err.status == 500:
            log.exception("error while streaming %s", gen.id)
        yield f"data: {json.dumps(err.body())}\n\n"
    finally:
        gen.close()
    yield "data: [DONE]\n\n"


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


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


def _server_error(e: Exception) -> APIError:
    if isinstance(e, EngineDeadError):
        return APIError(503, f"the engine is not available: {e}", None, "engine_dead")
    return APIError(500, "internal server error; see the server log", None, "internal_error")


# ---- the app ----------------------------------------------------------------------------


def build_app(client: EngineClient, tokenizer: Tokenizer, config: ServerConfig) -> FastAPI:
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
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(request: Request, e: InvalidRequestError) -> JSONResponse:
        return await api_error(request, APIError.invalid(e))

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, e: EngineDeadError) -> JSONResponse:
        return await api_error(request, _server_error(e))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return await api_error(request, APIError(e.status_code, str(e.detail)))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        # Starlette re-raises it after this response, and uvicorn logs the traceback
        log.error("internal error in %s %s: %r", request.method, request.url.path, e)
        return await api_error(request, _server_error(e))

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
        prompts = [server.encode(p) for p in req.prompts()]
        gen = Generation(server, "cmpl", prompts, req)
        for ids in prompts:
            server.check_length(ids, gen.params.max_tokens, "prompt")
        return await _generate(request, gen, CompletionShape(req, server.token_str))

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await _read_json(request, ChatCompletionRequest, limit)
        server.check_model(req.model)
        ids = server.render_chat(req)
        gen = Generation(server, "chatcmpl", [ids], req)
        server.check_length(ids, gen.params.max_tokens, "messages")
        return await _generate(request, gen, ChatShape(req, server.token_str))

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
        server.check_tokens(req.tokens, "tokens")
        return {"prompt": tokenizer.decode(req.tokens)}

    app.include_router(v1)
    return app
