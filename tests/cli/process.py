"""The CLI as a user runs it: `python -m nanovllm ...` in a subprocess, read as it writes."""

import os
import selectors
import signal
import subprocess
import sys
import time


def run_cli(*args: str, input: str = "", timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the CLI to the end; standard input is `input` (never the terminal)."""
    return subprocess.run(
        [sys.executable, "-m", "nanovllm", *args],
        input=input, capture_output=True, text=True, timeout=timeout,
    )


def start_cli(*args: str, group: bool = False) -> subprocess.Popen:
    """Start the CLI with pipes for all three streams (bytes). `group`: in a process group
    of its own, so that os.killpg reaches its children too, as a terminal's Ctrl-C does.
    With Python's fault handler on, so `finish` can have a stuck one print its stacks."""
    return subprocess.Popen(
        [sys.executable, "-m", "nanovllm", *args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=group, env={**os.environ, "PYTHONFAULTHANDLER": "1"},
    )


def read_until(stream, text: bytes = b"", timeout: float = 60) -> bytes:
    """Read `stream` (a pipe) until what was read contains `text` (with no `text`: until
    anything comes); returns all of it."""
    seen = b""
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(stream, selectors.EVENT_READ)
        while not seen or text not in seen:
            left = deadline - time.monotonic()
            assert left > 0 and sel.select(left), f"no {text!r} in {timeout} s; got {seen!r}"
            chunk = os.read(stream.fileno(), 65536)
            assert chunk, f"the stream ended without {text!r}; got {seen!r}"
            seen += chunk
    return seen


def finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[int, str, str]:
    """Wait for `proc` to exit; its status and the rest of its stdout and stderr. Still
    running after `timeout` s: aborted (SIGABRT, on which the fault handler prints every
    thread's stack), and the test fails with the end of its stderr, stacks included."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        _, err = proc.communicate(timeout=30)
        raise AssertionError(f"still running after {timeout} s; the end of its stderr:\n"
                             + err.decode(errors="replace")[-8000:]) from None
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")


def press_ctrl_c_in_a_finalizer() -> None:
    """Send this process SIGINT from inside a finalizer, where the KeyboardInterrupt its
    handler raises is dropped by Python (printed through sys.unraisablehook), as one that
    lands in an import lock's callback or process start-up's finalizers is."""

    class Dropper:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)  # the handler runs here, inside __del__: what it raises is dropped

    Dropper()  # made and collected at once
