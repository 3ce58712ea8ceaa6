"""Optional torch.compile of the small elementwise pieces (norms, RoPE, SiLU).

Each is several tiny kernels in eager mode and one fused kernel compiled. Off by default
(`EngineConfig.torch_compile`): on CUDA the hand-written Triton kernels of `fused.py` take
precedence when `fused_kernels` is on (the default), so this matters only with them off or
on other devices; it adds ~30 s to start-up (BENCHMARKS.md).
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
