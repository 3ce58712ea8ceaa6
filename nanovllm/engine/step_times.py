"""Running totals of wall time by phase (no torch: the server's engine loop uses it too)."""

import gc
import time

STEP_PHASES = ("schedule", "launch", "wait", "postprocess", "outputs")  # LLMEngine.step's


class StepTimes:
    """Where step() spends its wall time, as running totals in seconds: host work
    (schedule, launch, postprocess) against waiting for the device (wait). The server's
    engine loop keeps one of its own for the time between steps (engine_loop.py)."""

    def __init__(self, phases: tuple[str, ...] = STEP_PHASES) -> None:
        self.totals = dict.fromkeys(phases, 0.0)
        self._phase = ""
        self._start = 0.0

    def __call__(self, phase: str) -> "StepTimes":
        self._phase = phase
        return self

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.totals[self._phase] += time.perf_counter() - self._start


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
