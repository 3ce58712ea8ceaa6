"""Prometheus metrics, named as vLLM's with a `nanovllm:` prefix.

Engine numbers (queues, KV cache, token counters, finished requests) come from a fresh
snapshot taken at each scrape; latency histograms are observed here, in the front end.
"""

import os

from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from nanovllm.engine.messages import EngineStats
from nanovllm.entrypoints.openai.metrics_dir import MULTIPROC_ENV  # several front ends

disable_created_metrics()  # no *_created series: process start times, noise on every scrape

# EngineStats field -> (metric name, help)
_GAUGES = {
    "num_requests_running": ("nanovllm:num_requests_running", "Requests in the running batch."),
    "num_requests_waiting": ("nanovllm:num_requests_waiting", "Requests waiting to be scheduled."),
    "kv_cache_usage": ("nanovllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)."),
    "num_kv_blocks": ("nanovllm:num_kv_blocks", "KV cache blocks in all."),
    "num_free_kv_blocks": ("nanovllm:num_free_kv_blocks", "KV cache blocks free."),
    "num_host_kv_blocks": ("nanovllm:num_host_kv_blocks", "Host-tier KV blocks in all."),
    "num_free_host_kv_blocks": ("nanovllm:num_free_host_kv_blocks",
                                "Host-tier KV blocks not held by a swapped sequence."),
    "gc_frozen_objects": ("nanovllm:engine_gc_frozen_objects",
                          "Objects of the engine process's start-up that its garbage "
                          "collector no longer walks."),
}
_COUNTERS = {  # prometheus_client appends _total
    "prefix_cache_queries": (
        "nanovllm:prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache.",
    ),
    "prefix_cache_hits": ("nanovllm:prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    "num_preemptions": ("nanovllm:num_preemptions", "Sequences preempted."),
    "num_swaps": ("nanovllm:num_preemptions_swapped",
                  "Sequences preempted by swap (their blocks kept in host memory)."),
    "prompt_tokens": ("nanovllm:prompt_tokens", "Prompt tokens of admitted requests."),
    "generation_tokens": ("nanovllm:generation_tokens", "Tokens generated."),
    "num_steps": ("nanovllm:engine_steps", "Engine steps run."),
    "num_prefill_steps": ("nanovllm:engine_prefill_steps",
                          "Engine steps that ran prompt tokens (prefill alone or mixed)."),
}

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_PER_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
_E2E = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class _EngineCollector:
    """Turns the snapshot set just before a scrape into metric families."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.snapshot: list[tuple[int, EngineStats]] | None = None

    def describe(self) -> list:
        return []  # no collect() at registration: there is no snapshot then

    def collect(self):
        """One sample per engine replica (`replica` label) of every engine number."""
        snaps = self.snapshot
        if not snaps:
            return
        name = self.model_name
        for key, (metric, doc) in _GAUGES.items():
            yield _family(GaugeMetricFamily, metric, doc, name, snaps, key)
        for key, (metric, doc) in _COUNTERS.items():
            yield _family(CounterMetricFamily, metric, doc, name, snaps, key)
        yield _by_label(
            "nanovllm:request_success", "Finished requests by finish reason.",
            "finished_reason", name, snaps, lambda s: s.finished)
        yield _by_label(
            "nanovllm:prefix_cache_hit_blocks",
            "Cached prefix blocks of admitted prompts, by tier (host: copied back).",
            "tier", name, snaps, lambda s: {"device": s.kv_block_events["hit_device"],
                                            "host": s.kv_block_events["hit_host"]})
        yield _by_label(
            "nanovllm:kv_blocks_copied",
            "KV blocks copied between the device and the host tier, by why.",
            "kind", name, snaps, lambda s: {k: s.kv_block_events[k] for k in
                                            ("swapped_out", "swapped_in", "offloaded")})
        yield _by_label(
            "nanovllm:engine_loop_seconds",
            "The engine process's wall time by phase: idle (no work), receive (messages "
            "while working), schedule, launch, wait (for the device), postprocess, outputs "
            "(the step's outputs), send (to the front ends).",
            "phase", name, snaps, lambda s: s.loop_seconds)
        yield _by_label(
            "nanovllm:engine_gc_seconds",
            "The engine process's garbage-collector pauses by generation (2: full).",
            "generation", name, snaps, lambda s: s.gc_seconds)


def _by_label(metric: str, doc: str, label: str, model: str, snaps, values):
    """A counter with one sample per replica and per key of `values(snapshot)`."""
    family = CounterMetricFamily(metric, doc, labels=["model_name", "replica", label])
    for i, s in snaps:
        for key, value in values(s).items():
            family.add_metric([model, str(i), key], value)
    return family


def _family(cls, metric: str, doc: str, model: str, snaps, key: str):
    family = cls(metric, doc, labels=["model_name", "replica"])
    for i, s in snaps:
        family.add_metric([model, str(i)], getattr(s, key))
    return family


class Metrics:
    """The server's registry: engine snapshot collector plus front-end histograms.
    Time to first token and per output token are observed for streamed requests only:
    the engine reports a non-streamed request once, at its end.

    With several front-end processes (`--api-server-count`), `nanovllm serve` sets
    PROMETHEUS_MULTIPROC_DIR before prometheus_client is imported (metrics_dir.py): each
    process's histograms then live in files there, and every process's /metrics sums them
    all (prometheus_client's multiprocess mode), whichever process the scrape reaches."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self._engine = _EngineCollector(model_name)
        self.registry.register(self._engine)
        shared = bool(os.environ.get(MULTIPROC_ENV))
        if shared:
            MultiProcessCollector(self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]):
            # shared: observed into this process's file, collected from every process's
            h = Histogram(name, doc, ["model_name"], registry=None if shared else self.registry,
                          buckets=buckets)
            return h.labels(model_name)

        self.ttft = histogram(
            "nanovllm:time_to_first_token_seconds", "Time to first token (streamed).", _LATENCY
        )
        self.tpot = histogram(
            "nanovllm:time_per_output_token_seconds",
            "Time per output token after the first (streamed).",
            _PER_TOKEN,
        )
        self.e2e = histogram("nanovllm:e2e_request_latency_seconds", "Arrival to last token.", _E2E)
        self.queue_time = histogram(
            "nanovllm:request_queue_time_seconds", "Time waiting before first scheduled.", _LATENCY
        )

    def render(self, snapshot: list[tuple[int, EngineStats]] | None) -> bytes:
        """The text exposition, with the engine numbers of each replica's snapshot (None:
        leave them out)."""
        self._engine.snapshot = snapshot
        try:
            return generate_latest(self.registry)
        finally:
            self._engine.snapshot = None
