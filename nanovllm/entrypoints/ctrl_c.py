"""A Ctrl-C that Python would drop while something loads or starts."""

import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def ctrl_c_kept() -> Iterator[None]:
    """Ctrl-C raises KeyboardInterrupt as usual, and is remembered: one that lands in an
    import lock's callback or a finalizer (process start-up runs several) is printed as
    "Exception ignored" with a traceback and dropped by Python, and the command goes on to
    its end (seen in CI while `generate` loaded its model). Such a Ctrl-C is raised again
    once the block is done, and not printed."""
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
