"""Where a GPU run's device sits idle between steps (benchmarks/offline.py --gpu-gaps).

Each step's launch is bracketed by two CUDA events on the engine's stream: one recorded
before the host queues anything of the step (its inputs' copies included), one after its
last kernel. The device reaches a step's first event when it has finished the step before
and the host has queued the event, whichever is later, so the time from one step's last
event to the next one's first is the device idle, waiting on the host. A step's own span
is its device time. Both are reported by the kind of step and its row count, beside the
host's time from one launch to the next: where the host is slower than the device, the
device waits. Only a diagnostic; empty off CUDA."""

import contextlib
import time

import torch

BUCKETS = ((1, 16), (17, 64), (65, 128), (129, 256), (257, 1 << 30))


def bucket_name(batch) -> str:
    rows = len(batch.seqs)
    if batch.num_tokens != rows:
        return "prefill or mixed"
    for lo, hi in BUCKETS:
        if lo <= rows <= hi:
            return f"decode {lo}-{hi}" if hi < 1 << 30 else f"decode {lo}+"
    return "decode"


@contextlib.contextmanager
def gpu_gaps(on: bool, runner):
    """With `on` and a GPU: bracket every `runner.launch` in the block with CUDA events and
    yield a dict that, once the block ends, holds per kind of step: steps, device seconds,
    device idle seconds before the step, host seconds from the launch before."""
    found: dict = {}
    if not (on and torch.cuda.is_available()):
        yield found
        return
    marks = []  # (kind, host time at launch, first event, last event)
    launch = runner.launch

    def bracketed(batch, prev=None):
        first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        first.record()
        handle = launch(batch, prev)
        last.record()
        marks.append((bucket_name(batch), t, first, last))
        return handle

    runner.launch = bracketed  # an attribute of the instance, over its class's method
    try:
        yield found
    finally:
        del runner.launch
    torch.cuda.synchronize()
    for i, (kind, t, first, last) in enumerate(marks):
        row = found.setdefault(kind, {"steps": 0, "device_s": 0.0, "idle_before_s": 0.0,
                                      "host_between_launches_s": 0.0})
        row["steps"] += 1
        row["device_s"] += first.elapsed_time(last) / 1e3
        if i:
            row["idle_before_s"] += marks[i - 1][3].elapsed_time(first) / 1e3
            row["host_between_launches_s"] += t - marks[i - 1][1]
    total = {k: sum(r[k] for r in found.values()) for k in
             ("steps", "device_s", "idle_before_s", "host_between_launches_s")}
    found["all"] = total
