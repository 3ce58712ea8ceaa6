"""Errors as the client sees them: an HTTP status and OpenAI's {"error": {...}} body, and the
status each kind of failure maps to (the engine names a reason, never a status)."""

from typing import Any

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
    def from_validation(cls, e: ValidationError) -> "APIError":
        """A request body that does not parse as its pydantic model: 400."""
        errors = e.errors()
        loc = errors[0]["loc"]
        param = str(loc[0]) if loc else None
        if len([x for x in errors if x["loc"][:1] == loc[:1]]) > 1:  # every union member failed
            msg = f"{param}: the value matches none of its accepted types"
        else:
            msg = f"{'.'.join(str(x) for x in loc) or 'body'}: {errors[0]['msg']}"
        return cls(400, msg, param, "invalid_value")


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
