"""What /openapi.json publishes: the request body of each route (read by hand, so FastAPI
cannot see it) and every response a route gives, as pydantic models of the bodies that
responses.py and app.py write. Clients and fuzzers (tests/server/test_fuzz.py) rely on it."""

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

# ---- error bodies -----------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body; never a trace."""

    error: ErrorDetail


ERRORS = {
    400: "The request is invalid: the body, a field or the prompt; `param` names it.",
    401: "The API key is missing or wrong: send 'Authorization: Bearer KEY'.",
    404: "The model is not the one this server serves.",
    413: "The body is larger than the server's --max-request-bytes.",
    415: "The body is not sent as JSON ('Content-Type: application/json', uncompressed).",
    429: "The engine's waiting queue is full; retry after Retry-After seconds.",
    503: "The engine process is gone.",
}

# ---- success bodies ---------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float | None
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    """`content` is null when the reply is all tool calls (or all reasoning, cut short);
    `reasoning_content` / `reasoning` with --reasoning-parser, `tool_calls` with tools."""

    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChunk(CompletionResponse):
    """One server-sent event of a streamed completion (`usage` with include_usage only)."""

    usage: Usage | None = None


class ToolCallDelta(ToolCallOut):
    index: int  # the call's number within its choice


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None


class ChatCompletionChunk(ChatCompletionResponse):
    """One server-sent event of a streamed chat completion."""

    object: Literal["chat.completion.chunk"]
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


CHUNKS = [CompletionChunk, ChatCompletionChunk]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


# ---- what a route declares --------------------------------------------------------------------

def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _events(chunk: type[BaseModel]) -> dict[str, Any]:
    """With stream=true: each server-sent event's data is a `chunk`, or an error body when
    the stream fails after it started, and the last is [DONE]."""
    json_data = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [_ref(chunk), _ref(ErrorResponse)]},
    }
    data = {"if": {"const": "[DONE]"}, "else": json_data}
    event = {"type": "object", "required": ["data"], "properties": {"data": data}}
    return {"text/event-stream": {"schema": {**event, "description": _events.__doc__}}}


def responses(
    ok: type[BaseModel] | None, errors: tuple[int, ...], *, chunk: type[BaseModel] | None = None
) -> dict[int | str, dict[str, Any]]:
    """FastAPI's `responses=` for a route: 200 with `ok` (and server-sent events of `chunk`
    when it can stream), each status of `errors` with OpenAI's error body."""
    out: dict[int | str, dict[str, Any]] = {
        code: {"model": ErrorResponse, "description": ERRORS[code]} for code in errors
    }
    if 429 in out:
        retry = {"description": "seconds to wait", "schema": {"type": "integer"}}
        out[429]["headers"] = {"Retry-After": retry}
    if ok is not None:
        out[200] = {"model": ok, "description": "Success."}
        if chunk is not None:
            out[200]["content"] = _events(chunk)
    return out


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route that reads `model` from its body by hand."""
    content = {"application/json": {"schema": _ref(model)}}
    return {"requestBody": {"required": True, "content": content}}


def publish(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Serve app's OpenAPI schema with `models` (and the models they use) among its
    components, where the references of json_body and of the event streams point."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, description=app.description,
                routes=app.routes,
            )
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in [*models, *CHUNKS]:
                found = model.model_json_schema(ref_template="#/components/schemas/{model}")
                for name, definition in {**found.pop("$defs", {}), model.__name__: found}.items():
                    assert components.get(name, definition) == definition, f"two {name} schemas"
                    components[name] = definition
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
