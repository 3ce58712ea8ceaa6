"""A request's JSON body, read by hand: a JSON content type, the size limit while it streams
in, strict JSON (UTF-8, no NaN, bounded depth, no lone surrogates), then its pydantic
model. Each refusal is an APIError that says what to send instead."""

import json
import re
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect, Request

from nanovllm.entrypoints.openai.errors import APIError, render_path

T = TypeVar("T", bound=BaseModel)
MAX_DEPTH = 64  # nested arrays and objects; real requests, tool schemas included, need < 20
# a high surrogate escape without a low one after it, or a low one without a high before it
_LONE_SURROGATE = re.compile(
    r"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])"
    r"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}"
)


async def read_json(request: Request, model: type[T], limit: int) -> T:
    """The body as `model`: 415 unless it is sent as JSON, 413 past `limit` bytes (declared
    or sent), 400 if it is not strict JSON or does not fit `model`."""
    check_content_type(request.headers)
    data = parse_json(await read_body(request, limit))
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise APIError.from_validation(e, data) from None


def body_read(request: Request) -> bool:
    """Whether the whole body has been read (if not, the connection is closed after the
    answer rather than drained of a body of any size)."""
    return getattr(request.state, "body_read", False)


def check_content_type(headers: Headers) -> None:
    """415 unless the body is JSON: application/json (any UTF-8 charset parameter),
    application/*+json, or no Content-Type at all, uncompressed."""
    encoding = headers.get("content-encoding", "identity").strip().lower()
    if encoding != "identity":
        msg = f"the body is compressed ({encoding}); send it uncompressed"
        raise APIError(415, msg, None, "unsupported_media_type")
    given = headers.get("content-type", "").strip()
    if not given:
        return
    media, *params = (part.strip().lower() for part in given.split(";"))
    charset = next((p.split("=", 1)[1].strip('"') for p in params if p.startswith("charset=")),
                   "utf-8")
    json_type = media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )
    if not json_type:
        msg = f"send the body as JSON with 'Content-Type: application/json', not {given!r}"
        raise APIError(415, msg, None, "unsupported_media_type")
    if charset not in ("utf-8", "utf8"):
        msg = f"send JSON encoded as UTF-8 ('Content-Type: application/json'), not {given!r}"
        raise APIError(415, msg, None, "unsupported_media_type")


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed `limit` bytes."""
    too_large = APIError(
        413, f"the request body is larger than the limit of {limit} bytes", None, "too_large"
    )
    length = request.headers.get("content-length", "")
    if length.isdigit() and (len(length) > 18 or int(length) > limit):
        raise too_large
    body = bytearray()
    try:
        async for piece in request.stream():
            body += piece
            if len(body) > limit:
                raise too_large
    except ClientDisconnect:  # nobody reads the answer; it only ends the request quietly
        msg = "the client closed the connection before sending the whole body"
        raise APIError(400, msg, None, "incomplete_body") from None
    request.state.body_read = True
    return bytes(body)


def parse_json(body: bytes) -> dict[str, Any]:
    """A JSON object from `body`, or a 400 that says what is wrong with it."""
    try:
        text = body.decode("utf-8-sig")  # json.loads would guess UTF-16/32, pass surrogates
    except UnicodeDecodeError as e:
        msg = f"the body is not valid UTF-8 (byte {e.start}); send JSON encoded as UTF-8"
        raise APIError(400, msg, None, "invalid_json") from None
    try:
        data = json.loads(text, parse_constant=_not_json)
    except RecursionError:
        raise _too_deep() from None
    except ValueError as e:
        raise APIError(400, f"the body is not valid JSON: {e}", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object", None, "invalid_json")
    if text.count("[") + text.count("{") > MAX_DEPTH and _deeper_than(data, MAX_DEPTH):
        raise _too_deep()
    if _LONE_SURROGATE.search(text):
        path = _lone_surrogate_at(data, ())
        if path:
            msg = (f"{render_path(path)}: the text holds a lone UTF-16 surrogate escape "
                   "(\\ud800-\\udfff), which is not a character; send valid Unicode")
            raise APIError(400, msg, render_path(path[:1]), "invalid_value")
    return data


def _not_json(name: str) -> None:
    raise ValueError(f"{name} is not a JSON value; send a finite number")


def _too_deep() -> APIError:
    msg = f"the body nests arrays and objects deeper than {MAX_DEPTH} levels"
    return APIError(400, msg, None, "invalid_json")


def _deeper_than(data: Any, limit: int) -> bool:
    """Whether arrays and objects nest more than `limit` levels (level by level, no
    recursion, each value seen once)."""
    level = [data]
    for _ in range(limit):
        level = [
            child
            for node in level
            for child in (node.values() if isinstance(node, dict) else node)
            if isinstance(child, dict | list)
        ]
        if not level:
            return False
    return True


def _lone_surrogate_at(value: Any, path: tuple) -> tuple | None:
    """The path of the first key or string holding a lone surrogate (depth is bounded)."""
    if isinstance(value, str):
        return None if _is_unicode(value) else path
    if not isinstance(value, dict | list):
        return None
    for key, child in value.items() if isinstance(value, dict) else enumerate(value):
        if isinstance(key, str) and not _is_unicode(key):
            return (*path, key)
        found = _lone_surrogate_at(child, (*path, key))
        if found:
            return found
    return None


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
