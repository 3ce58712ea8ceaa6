"""nano-vLLM: a compact, readable LLM inference engine."""

from nanovllm.core.errors import ConfigError, InvalidRequestError, ModelLoadError, NanoVLLMError
from nanovllm.core.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "NanoVLLMError",
    "InvalidRequestError",
    "ConfigError",
    "ModelLoadError",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # torch-free until the engine is asked for, so `nanovllm.core` imports without torch
    if name == "LLM":
        from nanovllm.engine.llm import LLM

        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        from nanovllm.engine import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'nanovllm' has no attribute {name!r}")
