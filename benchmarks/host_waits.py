"""Where a GPU run makes the host wait: the CUDA caching allocator's mallocs, frees and
retries, and the Python lines torch's sync debug mode flags (benchmarks/offline.py
--sync-debug). Both are empty off CUDA."""

import collections
import contextlib
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
