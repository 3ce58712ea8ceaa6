"""Running totals of wall time by phase (no torch: the server's engine loop uses it too)."""

import gc
import time

# LLMEngine.step's; grammar: structured-output bitmasks (engine/structured_output.py)
STEP_PHASES = ("schedule", "launch", "wait", "postprocess", "grammar", "outputs")


class StepTimes:
    """Where step() spends its wall time, as running totals in seconds: host work
    (schedule, launch, postprocess) against waiting for the device (wait). The server's
    engine loop keeps one of its own for the time between steps (engine_loop.py). A phase
    timed inside another (a step's tokens resolved during a structured-output launch) is
    taken out of the outer one: each second is counted once."""

    def __init__(self, phases: tuple[str, ...] = STEP_PHASES) -> None:
        self.totals = dict.fromkeys(phases, 0.0)
        self._next = ""
        self._open: list[str] = []  # the phases entered, innermost last
        self._start = 0.0  # when the innermost one last resumed

    def __call__(self, phase: str) -> "StepTimes":
        self._next = phase
        return self

    def __enter__(self) -> None:
        now = time.perf_counter()
        if self._open:
            self.totals[self._open[-1]] += now - self._start
        self._open.append(self._next)
        self._start = now

    def __exit__(self, *exc) -> None:
        now = time.perf_counter()
        self.totals[self._open.pop()] += now - self._start
        self._start = now


class GcPauses:
    """The garbage collector's pauses in this process (every thread stops for them), as
    running totals in seconds by generation ("0", "1", "2": a full collection), counted
    from `gc.callbacks` until `close()`."""

    def __init__(self) -> None:
        self.totals = {"0": 0.0, "1": 0.0, "2": 0.0}
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.totals[str(info["generation"])] += time.perf_counter() - self._start

    def close(self) -> None:
        gc.callbacks.remove(self._callback)
