"""Where a GPU run makes the host wait: the CUDA caching allocator's mallocs, frees and
retries (and with benchmarks/offline.py --malloc-trace the lines that made each malloc),
and the Python lines torch's sync debug mode flags (--sync-debug). All are empty off
CUDA."""

import collections
import contextlib
import gc
import time
import warnings

import torch

ALLOCATOR_COUNTS = ("num_device_alloc", "num_device_free", "num_alloc_retries",
                    "num_sync_all_streams")


def allocator_counts() -> dict[str, int]:
    """The CUDA caching allocator's running counts of what makes the host wait: device
    mallocs and frees (a cudaFree synchronizes the device), retries after a failed malloc
    (which free the cache first). Empty off CUDA."""
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {k: stats.get(k, 0) for k in ALLOCATOR_COUNTS}


@contextlib.contextmanager
def sync_watch(on: bool):
    """With `on` and a GPU: torch's sync debug mode for the block, yielding a Counter of
    the Python lines (and messages) where an operation made the host wait for the GPU; an
    empty Counter otherwise. Only a diagnostic: the checks slow the run."""
    found: collections.Counter = collections.Counter()
    if not (on and torch.cuda.is_available()):
        yield found
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        found[f"{w.filename}:{w.lineno}: {str(w.message).splitlines()[0][:80]}"] += 1


@contextlib.contextmanager
def malloc_watch(on: bool):
    """With `on` and a GPU: torch's allocator history for the block, yielding a Counter of
    where its device mallocs (the caching allocator's new segments: a cudaMalloc each, host
    time in the step that needs it) were made, by the innermost engine frame and the
    segment's size; an empty Counter otherwise. Only a diagnostic: recording each
    allocation's Python stack slows the run."""
    found: collections.Counter = collections.Counter()
    if not (on and torch.cuda.is_available()):
        yield found
        return
    record = torch.cuda.memory._record_memory_history
    record(enabled="all", context="all", stacks="python", max_entries=500_000)
    try:
        yield found
    finally:
        snapshot = torch.cuda.memory._snapshot()
        record(enabled=None)
        for traces in snapshot.get("device_traces", []):
            for event in traces:
                if event.get("action") != "segment_alloc":
                    continue
                frames = [f for f in event.get("frames") or []
                          if "/nanovllm/" in f.get("filename", "")
                          and "/benchmarks/" not in f.get("filename", "")]
                where = (f"{frames[0]['filename'].rsplit('/nanovllm/', 1)[-1]}:"
                         f"{frames[0]['line']} {frames[0]['name']}" if frames else "?")
                found[f"{where} ({event.get('size', 0) / 2**20:,.1f} MiB)"] += 1


@contextlib.contextmanager
def triton_compiles():
    """Yield a list that gathers (kernel name, seconds) for each Triton kernel variant
    built while the block runs: a miss in the in-process cache, answered from Triton's disk
    cache or by compiling. A timed run should find none: each is host time the warm-up
    left for the requests. Empty where Triton is absent or has no `_do_compile`."""
    found: list[tuple[str, float]] = []
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        yield found
        return
    inner = getattr(JITFunction, "_do_compile", None)
    if inner is None:
        yield found
        return

    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(self, *args, **kwargs)
        finally:
            found.append((getattr(self, "__name__", repr(self)), time.perf_counter() - t0))

    JITFunction._do_compile = timed
    try:
        yield found
    finally:
        JITFunction._do_compile = inner


def compiles_summary(found: list[tuple[str, float]]) -> dict:
    """`triton_compiles`' list as a count, total seconds and a count per kernel."""
    return {"count": len(found), "seconds": sum(s for _, s in found),
            "kernels": dict(collections.Counter(name for name, _ in found).most_common())}


@contextlib.contextmanager
def gc_pauses():
    """Yield a dict that gathers Python's garbage collections while the block runs: their
    count and seconds, by generation. A start-up that leaves many tracked objects (a
    compiler's, say) makes each full collection in the timed run long."""
    found = {"count": 0, "seconds": 0.0, "by_generation": {}}
    started: list[float] = []

    def watch(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            dt = time.perf_counter() - started.pop()
            found["count"] += 1
            found["seconds"] += dt
            gen = str(info.get("generation"))
            found["by_generation"][gen] = found["by_generation"].get(gen, 0) + 1

    gc.callbacks.append(watch)
    try:
        yield found
    finally:
        gc.callbacks.remove(watch)


class HostUsage:
    """What the host spent over a block of code, from getrusage: user and system CPU
    seconds, minor and major page faults, voluntary and involuntary context switches. A
    first run's extra system time or faults point at work the process did not do before
    (pages touched or made writable again), not at the engine's own code."""

    FIELDS = (("user_s", "ru_utime"), ("system_s", "ru_stime"), ("minor_faults", "ru_minflt"),
              ("major_faults", "ru_majflt"), ("voluntary_switches", "ru_nvcsw"),
              ("involuntary_switches", "ru_nivcsw"))

    def __enter__(self) -> dict:
        import resource

        self._resource = resource
        self._start = resource.getrusage(resource.RUSAGE_SELF)
        self.found: dict = {}
        return self.found

    def __exit__(self, *exc) -> None:
        end = self._resource.getrusage(self._resource.RUSAGE_SELF)
        for name, field in self.FIELDS:
            self.found[name] = getattr(end, field) - getattr(self._start, field)


@contextlib.contextmanager
def run_diagnostics():
    """Yield a dict that, when the block ends, holds what a timed run left behind: the
    Triton variants it built (`triton_compiles`), its collections (`gc_pauses`) and its
    host usage (`HostUsage`), under the keys offline_report.py prints."""
    found: dict = {}
    with triton_compiles() as compiles, gc_pauses() as gcs, HostUsage() as usage:
        yield found
    found.update(triton_compiles=compiles_summary(compiles), gc=gcs, host_usage=usage)
