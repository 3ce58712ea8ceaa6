"""Load the engine for `generate` and `chat`, logging what happens (shown with --verbose)."""

import argparse
import logging
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from nanovllm.core.config import EngineConfig

log = logging.getLogger("nanovllm.cli")


def load_engine(args: argparse.Namespace, config: EngineConfig):
    """An LLMEngine for `args.model` (the default model when None)."""
    start = time.perf_counter()
    with _ctrl_c_kept():
        log.info("loading %s", args.model or "the default model, SmolLM2-135M-Instruct")
        from nanovllm.engine.llm_engine import LLMEngine  # torch: seconds, after the line

        engine = LLMEngine(args.model, config)
    log.info("ready in %.1f s (context: %d tokens)", time.perf_counter() - start,
             engine.max_model_len)
    return engine


@contextmanager
def _ctrl_c_kept() -> Iterator[None]:
    """Ctrl-C raises KeyboardInterrupt as usual, and is remembered: one that lands in an
    import lock's callback or a finalizer is printed as "Exception ignored" with a traceback
    and dropped by Python, and the command loaded and ran to its end (seen in CI). Such a
    Ctrl-C is raised again once loading is done, and not printed."""
    pressed: list[bool] = []

    def on_sigint(signum, frame) -> None:
        pressed.append(True)
        raise KeyboardInterrupt

    def on_dropped(unraisable) -> None:
        if not isinstance(unraisable.exc_value, KeyboardInterrupt):
            hook(unraisable)

    previous, hook = signal.signal(signal.SIGINT, on_sigint), sys.unraisablehook
    sys.unraisablehook = on_dropped
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        sys.unraisablehook = hook
    if pressed:
        raise KeyboardInterrupt
