"""Errors as the client sees them: an HTTP status and OpenAI's {"error": {...}} body, and the
status each kind of failure maps to (the engine names a reason, never a status)."""

from typing import Any, NamedTuple

from pydantic import ValidationError

from nanovllm.core.errors import InvalidRequestError
from nanovllm.engine.messages import RejectReason
from nanovllm.entrypoints.openai.engine_client import EngineDeadError, RequestRejected

_ERROR_TYPES = {
    401: "authentication_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error for the client: an HTTP status and OpenAI's {"error": {...}} body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        kind = _ERROR_TYPES.get(self.status, "invalid_request_error")
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }

    @classmethod
    def from_validation(cls, e: ValidationError, data: Any = None) -> "APIError":
        """A request body `data` that does not parse as its pydantic model: 400 naming the
        deepest failing place (`messages[0].role`), or the value every type of a union
        refused."""
        places = [_place(x, data) for x in e.errors(include_url=False)]
        field = places[0].path[:1]
        places = [p for p in places if p.path[:1] == field]
        deepest = max(len(p.path) for p in places)
        places = [p for p in places if len(p.path) == deepest]
        # a member of the right type that refused the value says more than one of another type
        places = [p for p in places if not p.wrong_type] or places
        members = dict.fromkeys(p.tags[0] for p in places if p.tags)
        if len(members) > 1:  # no member of a union got further than another
            where = render_path(_common_prefix([p.path for p in places]))
            msg = f"{where}: the value matches none of its accepted types ({', '.join(members)})"
        else:
            msg = f"{render_path(places[0].path) or 'body'}: {places[0].message}"
        return cls(400, msg, str(field[0]) if field else None, "invalid_value")


class _Place(NamedTuple):
    path: tuple  # keys and indexes into the body
    tags: tuple[str, ...]  # what pydantic adds to a location in a union: 'str', 'list[int]'
    message: str
    wrong_type: bool  # the value is not of the type (rather than outside its bounds)


def _place(err: dict[str, Any], data: Any) -> _Place:
    """Where in `data` a pydantic error is, told apart from the union tags of its location."""
    path, tags, node = [], [], data
    loc = err["loc"]
    for i, key in enumerate(loc):
        missing = i == len(loc) - 1 and err["type"] == "missing"
        if isinstance(node, dict) and (key in node or missing):
            path.append(key)
            node = node.get(key)
        elif isinstance(node, list) and isinstance(key, int) and 0 <= key < len(node):
            path.append(key)
            node = node[key]
        else:
            tags.append(str(key).replace("constrained-", ""))
    message, given = err["msg"], err.get("input")
    if isinstance(given, str | int | float | bool) and len(repr(given)) <= 60:
        message += f", not {given!r}"
    return _Place(tuple(path), tuple(tags), message, err["type"].endswith("_type"))


def _common_prefix(paths: list[tuple]) -> tuple:
    first = paths[0]
    n = next((i for i, key in enumerate(first) if any(p[i] != key for p in paths)), len(first))
    return first[:n]


def render_path(path: tuple) -> str:
    """('messages', 0, 'role') -> 'messages[0].role'; keys that are not valid Unicode are
    escaped, so the error body can be encoded."""
    out = ""
    for key in path:
        if isinstance(key, int):
            out += f"[{key}]"
        else:
            key = str(key).encode("utf-8", "backslashreplace").decode()
            out += f".{key}" if out else key
    return out


def api_error(e: Exception) -> APIError:
    """What the client gets for `e`: 400 for an invalid request (from the front end's checks
    or the engine's), 429 with Retry-After when the engine is overloaded, 503 once the
    engine is gone, 500 (with no detail) for anything else."""
    match e:
        case APIError():
            return e
        case InvalidRequestError():
            return APIError(400, str(e), e.param, e.code or "invalid_value")
        case RequestRejected(rejection=r) if r.reason is RejectReason.OVERLOADED:
            headers = {"Retry-After": str(r.retry_after or 1)}
            return APIError(429, r.message, r.param, r.code or "rate_limit_exceeded", headers)
        case RequestRejected(rejection=r):
            return APIError(400, r.message, r.param, r.code or "invalid_value")
        case EngineDeadError():
            return APIError(503, f"the engine is not available: {e}", None, "engine_dead")
    return APIError(500, "internal server error; see the server log", None, "internal_error")
