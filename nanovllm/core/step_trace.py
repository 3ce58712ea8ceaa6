"""The step trace: one JSON object per line, written as the engine runs.

`LLM(..., trace="run.jsonl")` / `nanovllm serve --trace FILE` record it; `nanovllm trace
run.jsonl -o run.html` renders it (nanovllm/trace/). The format, version 1:

- line 1, the header:
  {"type": "header", "version": 1, "start": <unix time>, "block_size": B,
   "num_kv_blocks": <device blocks>, "num_host_blocks": <host blocks, 0 without a host tier>,
   "max_num_seqs": N, "max_num_batched_tokens": N, "config": {<the engine's settings>}}
- then one line per step:
  {"type": "step", "step": i, "t": <seconds from start to the step's start>,
   "dur": <seconds the step took>,
   "rows": [{"req": <request id>, "seq": <sequence id>, "kind": "prefill" | "decode",
             "tokens": <tokens computed this step>, "start": <tokens computed before>,
             "total": <the sequence's tokens>}],
   "waiting": <sequences waiting as the step ends>, "running": <and running>,
   "kv": {"device": {"used": n, "cached": n, "free": n},
          "host": {"used": n, "cached": n, "free": n}},
   "blocks": {"allocated": n, "freed": n, "hit_device": n, "hit_host": n,
              "swapped_out": n, "swapped_in": n, "offloaded": n},
   "preempted": [{"req": id, "seq": id, "kind": "swap" | "recompute"}],
   "arrived": [{"req": id, "seq": id, "prompt_tokens": n, "priority": p}],
   "finished": [{"req": id, "seq": id, "reason": "stop" | "length" | "abort" | ...,
                 "output_tokens": n}]}
  `kv` counts blocks after the step was scheduled: "used" held by a sequence, "cached" free
  but still holding a findable prefix, "free" the rest. `blocks` counts this step's events
  (the BlockManager's BLOCK_EVENTS): "allocated" fresh blocks taken, "freed" references
  dropped to zero, "hit_*" the cached prefix blocks of the sequences admitted this step, by
  tier, "swapped_out" / "swapped_in" blocks copied for preempted sequences, "offloaded"
  cached blocks copied to the host tier as they left the device.

No torch and no scheduler here: `SchedulerTrace` (core/trace.py) fills a StepTrace from a
Scheduler and its BlockManager, for the engine and the examples' stub runner alike.
"""

import json
import time
from typing import IO, Any

VERSION = 1


def read_trace(path: str) -> tuple[dict, list[dict]]:
    """A trace file's header and its step records; a ValueError that says what is wrong."""
    header, steps = None, []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
            kind = record.get("type") if isinstance(record, dict) else None
            if kind == "header":
                header = record
            elif kind == "step":
                steps.append(record)
            else:
                raise ValueError(f"{path}:{n}: a record of unknown type {kind!r}")
    if header is None:
        raise ValueError(f"{path}: no header line: is it a nano-vLLM step trace?")
    if header.get("version") != VERSION:
        raise ValueError(f"{path}: trace version {header.get('version')!r}; this reader "
                         f"reads version {VERSION}")
    return header, steps


class StepTrace:
    """Writes a trace: `header(...)` once, then `step(...)` per step; line-buffered, so a
    trace of a server that is killed still holds every step it finished. Without a target
    it writes nothing (the records are still returned)."""

    def __init__(self, target: str | IO[str] | None) -> None:
        if isinstance(target, str):
            self._file: IO[str] | None = open(target, "w", encoding="utf-8", buffering=1)
            self._owned = True
        else:
            self._file, self._owned = target, False
        self.start = time.time()
        self._clock0 = time.perf_counter()
        self.num_steps = 0
        self._arrived: list[dict] = []
        self._finished: list[dict] = []

    def now(self) -> float:
        """Seconds since the trace began."""
        return time.perf_counter() - self._clock0

    def header(self, **fields: Any) -> None:
        self._write({"type": "header", "version": VERSION, "start": self.start, **fields})

    def arrived(self, req: str, seq: int, prompt_tokens: int, priority: int = 0) -> None:
        self._arrived.append({"req": req, "seq": seq, "prompt_tokens": prompt_tokens,
                              "priority": priority})

    def finished(self, req: str, seq: int, reason: str, output_tokens: int) -> None:
        self._finished.append({"req": req, "seq": seq, "reason": reason,
                               "output_tokens": output_tokens})

    def step(self, t: float, dur: float, rows: list[dict], waiting: int, running: int,
             kv: dict, blocks: dict, preempted: list[dict]) -> dict:
        record = {"type": "step", "step": self.num_steps, "t": round(t, 6),
                  "dur": round(dur, 6), "rows": rows, "waiting": waiting, "running": running,
                  "kv": kv, "blocks": blocks, "preempted": preempted,
                  "arrived": self._arrived, "finished": self._finished}
        self._arrived, self._finished = [], []
        self.num_steps += 1
        self._write(record)
        return record

    def _write(self, record: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        if self._owned and not self._file.closed:
            self._file.close()
