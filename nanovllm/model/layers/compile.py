"""torch.compile for the small elementwise pieces (norms, RoPE, SiLU, sampling), on GPU only.

Each of these is several tiny kernels in eager mode; compiled, each becomes one fused
kernel. The runner turns it on for CUDA (`EngineConfig.torch_compile`); on CPU the plain
functions run, so tests need no compiler.
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
