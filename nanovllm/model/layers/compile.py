"""Optional torch.compile of the small elementwise pieces (norms, RoPE, SiLU).

Each is several tiny kernels in eager mode and one fused kernel compiled. Off by default
(`EngineConfig.torch_compile`) until it is measured on a warm GPU against the uncompiled
engine; it adds ~30 s to start-up (BENCHMARKS.md has the figures so far).
"""

from collections.abc import Callable

import torch

_enabled = False


def set_enabled(enabled: bool) -> None:
    global _enabled
    _enabled = enabled


def maybe_compiled(fn: Callable) -> Callable:
    compiled: list[Callable] = []

    def wrapper(*args, **kwargs):
        if not _enabled:
            return fn(*args, **kwargs)
        if not compiled:
            compiled.append(torch.compile(fn, dynamic=True, fullgraph=True))
        return compiled[0](*args, **kwargs)

    wrapper.__wrapped__ = fn
    return wrapper
