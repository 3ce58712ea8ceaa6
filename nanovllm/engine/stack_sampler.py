"""A wall-clock stack sampler for finding where a process's threads spend their time.

`NANOVLLM_SAMPLE_STACKS=/tmp/prof nanovllm serve ...` samples the engine process (written
to `/tmp/prof.engine`) and the HTTP front end (`/tmp/prof.front`) every millisecond. Unlike
cProfile it costs the sampled threads no per-call work and counts time spent waiting (for
the GPU, the GIL, a pipe) where it happens. The report is rewritten every few seconds, so
it survives a process that is killed.

Per thread: the lines most often on top of the stack ("self") and the functions most often
anywhere on it ("inclusive"), as a share of that thread's samples.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time

ENV = "NANOVLLM_SAMPLE_STACKS"


class StackSampler:
    def __init__(self, path: str, interval: float = 0.001, write_every: float = 3.0) -> None:
        self.path, self.interval, self.write_every = path, interval, write_every
        self.samples: collections.Counter[str] = collections.Counter()
        self.top: collections.Counter[tuple[str, str]] = collections.Counter()
        self.inclusive: collections.Counter[tuple[str, str]] = collections.Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def start(self) -> StackSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(1.0)
        self.write()

    def sample(self) -> None:
        me = threading.get_ident()
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            if ident == me:
                continue
            name = names.get(ident, str(ident))
            self.samples[name] += 1
            code = frame.f_code
            self.top[name, f"{os.path.basename(code.co_filename)}:{frame.f_lineno} "
                           f"{code.co_name}"] += 1
            seen = set()
            while frame is not None:
                code = frame.f_code
                key = f"{os.path.basename(code.co_filename)}:{code.co_name}"
                if key not in seen:
                    seen.add(key)
                    self.inclusive[name, key] += 1
                frame = frame.f_back

    def write(self) -> None:
        lines = []
        for name, n in self.samples.most_common():
            lines.append(f"== thread {name}: {n} samples")
            for title, counter in (("self (line)", self.top), ("inclusive", self.inclusive)):
                lines.append(f"-- {title}")
                rows = sorted(((v, k) for (t, k), v in counter.items() if t == name),
                              reverse=True)
                lines += [f"{100 * v / n:6.1f}% {k}" for v, k in rows[:40] if v >= n / 200]
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.write("\n".join(lines) + "\n")
        os.replace(tmp, self.path)

    def _run(self) -> None:
        next_write = time.monotonic() + self.write_every
        while not self._stop.wait(self.interval):
            self.sample()
            if time.monotonic() >= next_write:
                self.write()
                next_write = time.monotonic() + self.write_every


def from_env(suffix: str) -> StackSampler | None:
    """A started sampler writing to $NANOVLLM_SAMPLE_STACKS + suffix, if that is set."""
    base = os.environ.get(ENV)
    return StackSampler(base + suffix).start() if base else None
