"""Errors a user can cause. Each message says which value is wrong and what to change."""


class NanoVLLMError(Exception):
    """Base class of every error nano-vLLM raises on purpose."""


class InvalidRequestError(NanoVLLMError, ValueError):
    """A request (prompt or sampling parameters) is invalid; nothing was scheduled."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code  # a machine-readable kind (e.g. "context_length_exceeded"), or None


class ConfigError(NanoVLLMError, ValueError):
    """The engine configuration cannot work (e.g. a KV budget too small for one sequence)."""


class ModelLoadError(NanoVLLMError):
    """The model path does not exist, or holds an unsupported architecture or format."""
