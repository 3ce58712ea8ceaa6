"""The engine process of the server: one LLMEngine stepping in a loop, fed over a pipe.

The HTTP front end (entrypoints/openai) runs in the parent process and does everything
that is not the engine loop: HTTP, JSON, tokenization, chat templates, SSE. Between every
step the loop drains the pipe (new requests, aborts, stats queries), so an abort frees its
KV blocks before the next step, and a burst of HTTP work never delays a GPU step.

Outputs leave through an `Outbox` that writes only while the pipe has room, so a step
never waits for the front end either: while the front end is busy, new deltas merge into
those not yet sent, one per completion, and a slow front end gets fewer, larger deltas
instead of slowing the engine down.

Stop strings stay here, next to the scheduler: a stop string then ends its sequence in the
step that completed it (no tokens generated past it, usage exact), so a request with stop
strings is decoded here. A stream without them is decoded by the front end (AddRequest
detokenize=False): decoding every row on every step here cost a host-bound engine about a
tenth of its throughput, and the front end has a core to spare. What leaves is deltas: new
token ids (and new text where decoded here), built by the engine's delta outputs without
copying whole completions.

Messages (pickled tuples over one duplex multiprocessing Pipe):
  front end -> engine: ("add", AddRequest) | ("abort", id) | ("stats", token) | ("shutdown",)
  engine -> front end: ("ready", info) | ("fatal", message) | ("accepted", id)
      | ("rejected", id, http_status, message, retry_after_s) | ("out", [Delta, ...])
      | ("stats", token, dict)
"""

import logging
import math
import multiprocessing
import os
import select
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

from nanovllm.core.errors import NanoVLLMError
from nanovllm.core.sampling_params import SamplingParams
from nanovllm.core.sequence import FinishReason
from nanovllm.engine import stack_sampler
from nanovllm.engine.messages import EngineProcessConfig
from nanovllm.engine.outputs import RequestOutput

log = logging.getLogger("nanovllm.engine")


@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0  # lower value is served first and may preempt worse running work
    timeout: float | None = None  # seconds from arrival; then finish_reason "timeout"
    stream: bool = True  # False: one Delta per completion, when it ends
    # False: Deltas carry token ids but no text (the front end decodes), unless stop strings
    # need the engine to decode
    detokenize: bool = True


@dataclass
class Delta:
    """One completion's progress since its previous Delta."""

    request_id: str
    index: int
    text: str  # new text only: never broken UTF-8, never a stop string's prefix later cut
    token_ids: list[int]  # new token ids
    logprobs: list[dict[int, float]] | None  # one entry per new token, when asked for
    finish_reason: str | None
    stop_reason: int | str | None
    num_cached_tokens: int
    queue_time: float | None  # seconds waiting before first scheduled, once it is known

    def __reduce__(self):  # pickled as its fields alone: ~2x faster over the pipe
        return (Delta, (
            self.request_id, self.index, self.text, self.token_ids, self.logprobs,
            self.finish_reason, self.stop_reason, self.num_cached_tokens, self.queue_time,
        ))  # fmt: skip

    def merge(self, later: "Delta") -> "Delta":
        """This Delta followed by `later` (of the same completion), as one."""
        lps = self.logprobs
        if later.logprobs is not None:
            lps = later.logprobs if lps is None else lps + later.logprobs
        return Delta(
            self.request_id, self.index, self.text + later.text,
            self.token_ids + later.token_ids, lps, later.finish_reason, later.stop_reason,
            max(self.num_cached_tokens, later.num_cached_tokens),
            self.queue_time if self.queue_time is not None else later.queue_time,
        )


class Outbox:
    """The engine's end of the pipe, which never makes a step wait for the front end.

    Messages are written only while `poll()` says the pipe has room (a Unix socket says so
    once half its buffer is free); the rest wait in order for the next `flush` (when nothing
    waits and there is room, as usual, a step's Deltas go out as one message at once). Replies
    go first, so "accepted" precedes the Deltas of its request. While the front end lags,
    new Deltas merge into the unsent ones, one per completion: it later receives fewer,
    larger Deltas. Everything runs on the engine's thread: a writer thread was measured to
    cost ~5% of a host-bound engine's throughput in GIL hand-offs."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._replies: deque[tuple] = deque()
        self._deltas: dict[tuple[str, int], Delta] = {}
        self._poll = select.poll()
        self._poll.register(conn.fileno(), select.POLLOUT)

    @property
    def pending(self) -> bool:
        return bool(self._replies or self._deltas)

    def send(self, msg: tuple) -> None:
        self._replies.append(msg)
        self.flush()

    def put_deltas(self, deltas: list[Delta]) -> None:
        if not self.pending and self._poll.poll(0):
            self.conn.send(("out", deltas))  # the usual case: nothing waits, room to write
            return
        pending = self._deltas
        for d in deltas:
            key = (d.request_id, d.index)
            prev = pending.get(key)
            pending[key] = d if prev is None else prev.merge(d)
        self.flush()

    def flush(self, timeout: float = 0.0) -> bool:
        """Write what waits, one message at a time while the pipe has room (waiting up to
        `timeout` seconds for it); True once nothing is left."""
        while self.pending and self._poll.poll(timeout * 1000):
            if self._replies:
                self.conn.send(self._replies.popleft())
            else:
                deltas, self._deltas = self._deltas, {}
                self.conn.send(("out", list(deltas.values())))
        return not self.pending


def start_engine(config: EngineProcessConfig) -> tuple[multiprocessing.Process, Connection]:
    """Spawn the engine process; returns it and the front end's end of the pipe. The first
    message on the pipe is ("ready", info) or ("fatal", message)."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=True)
    proc = ctx.Process(
        target=run_engine_loop,
        args=(child, config),
        name="nanovllm-engine",
        daemon=True,
    )
    proc.start()
    child.close()
    return proc, parent


def run_engine_loop(conn: Connection, config: EngineProcessConfig) -> None:
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        from nanovllm.engine.llm_engine import LLMEngine

        engine = LLMEngine(config.model, config.engine)
    except Exception as e:  # a bad model path or config: the front end reports it
        log.exception("engine failed to start")
        conn.send(("fatal", f"{type(e).__name__}: {e}"))
        return
    loop = EngineLoop(engine, conn, config.max_num_waiting, config.log_interval)
    name = served_name(config.model)
    conn.send(("ready", {
        "model": name,
        "max_model_len": engine.max_model_len,
        "vocab_size": engine.model_config.vocab_size,
        "num_kv_blocks": engine.block_manager.num_blocks,
        "block_size": engine.config.block_size,
        "eos_token_ids": sorted(engine.eos_token_ids),
        "pid": os.getpid(),
    }))
    sampler = stack_sampler.from_env(".engine")  # NANOVLLM_SAMPLE_STACKS: where time goes
    try:
        loop.run()
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass  # the front end is gone: nothing left to serve
    finally:
        if sampler is not None:
            sampler.stop()


def served_name(model: str | None) -> str:
    """The model name clients use: a directory's whole name ("Qwen3-0.6B"), a file's name
    without its extension ("SmolLM2-135M-Instruct.Q4_1" from ".gguf")."""
    if not model:
        return "SmolLM2-135M-Instruct"
    path = Path(model)
    return path.stem if path.is_file() else path.name


class EngineLoop:
    def __init__(
        self, engine, conn: Connection, max_num_waiting: int | None, log_interval: float
    ) -> None:
        self.engine = engine
        self.conn = conn
        self.outbox = Outbox(conn)
        self.max_num_waiting = max_num_waiting
        self.log_interval = log_interval
        self.deadlines: dict[str, float] = {}
        self.finished: dict[str, int] = {r.value: 0 for r in FinishReason}
        self.running = True
        self._last_log = time.monotonic()
        self._last_gen = 0
        self.prompt_tokens = 0  # of accepted requests
        self._finish_times: deque[float] = deque()  # completions ended, for Retry-After

    # ---- the loop ---------------------------------------------------------------------

    def run(self) -> None:
        engine, outbox = self.engine, self.outbox
        while self.running:
            busy = engine.has_unfinished_requests()
            # between steps, take everything that arrived; when idle, sleep on the pipe (in
            # short naps while Deltas wait for the front end to make room for them)
            timeout = 0.0 if busy else self._idle_timeout()
            if outbox.pending:
                timeout = min(timeout, 0.002)
            while self.conn.poll(timeout):
                self._handle(self.conn.recv())
                timeout = 0.0
            self._expire()
            if engine.has_unfinished_requests():
                outs = engine.step()
                if outs:
                    self._send_outputs(outs)
            if outbox.pending:
                outbox.flush()
            self._maybe_log()
        outbox.flush(timeout=1.0)

    def _idle_timeout(self) -> float:
        now = time.monotonic()
        wake = self._last_log + self.log_interval
        if self.deadlines:
            wake = min(wake, min(self.deadlines.values()))
        return max(0.0, min(wake - now, 1.0))

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "add":
            self._add(msg[1])
        elif kind == "abort":
            self._finish(msg[1], FinishReason.ABORT, notify=False)
        elif kind == "stats":
            self.outbox.send(("stats", msg[1], self.stats()))
        elif kind == "shutdown":
            self.running = False

    def _add(self, req: AddRequest) -> None:
        engine = self.engine
        waiting = len(engine.scheduler.waiting)
        if self.max_num_waiting is not None and waiting >= self.max_num_waiting:
            retry = self._retry_after(waiting)
            self.outbox.send(("rejected", req.request_id, 429,
                              f"the server is at capacity ({waiting} requests waiting, "
                              f"--max-num-waiting {self.max_num_waiting}); retry in {retry} s",
                              retry))
            return
        try:  # the engine checks the ids (vocabulary, empty, longer than the context)
            engine.add_request(req.prompt_token_ids, req.params, req.request_id,
                               stream=req.stream, priority=req.priority, delta=True,
                               detokenize=req.detokenize)
        except NanoVLLMError as e:
            self.outbox.send(("rejected", req.request_id, 400, str(e), None))
            return
        self.prompt_tokens += len(req.prompt_token_ids)
        if req.timeout is not None:
            self.deadlines[req.request_id] = time.monotonic() + req.timeout
        self.outbox.send(("accepted", req.request_id))

    def _retry_after(self, waiting: int) -> int:
        """Seconds until the waiting queue has likely drained, from the rate requests
        finished over the last minute: 1 to 60."""
        now = time.monotonic()
        while self._finish_times and self._finish_times[0] < now - 60.0:
            self._finish_times.popleft()
        if len(self._finish_times) < 2:
            return 5  # nothing to go by yet
        rate = len(self._finish_times) / max(now - self._finish_times[0], 1.0)
        return max(1, min(60, math.ceil(waiting / rate)))

    def _expire(self) -> None:
        if not self.deadlines:
            return
        now = time.monotonic()
        for rid in [r for r, d in self.deadlines.items() if d <= now]:
            self._finish(rid, FinishReason.TIMEOUT, notify=True)

    def _finish(self, rid: str, reason: FinishReason, notify: bool) -> None:
        out = self.engine.finish_request(rid, reason)
        self.deadlines.pop(rid, None)
        if out is None:
            return
        for o in out.outputs:
            if o.finish_reason == reason.value:
                self.finished[reason.value] += 1
        if notify:
            self._send_outputs([out])

    # ---- outputs ----------------------------------------------------------------------

    def _send_outputs(self, outs: list[RequestOutput]) -> None:
        """The engine's delta outputs (see LLMEngine.add_request) as Deltas."""
        deltas = []
        for out in outs:
            rid, cached, queued = out.request_id, out.num_cached_tokens, out.queue_time
            for o in out.outputs:
                reason = o.finish_reason
                deltas.append(Delta(rid, o.index, o.text, o.token_ids, o.logprobs, reason,
                                    o.stop_reason, cached, queued))
                if reason is not None:
                    self._finish_times.append(time.monotonic())
                    if reason in ("stop", "length"):
                        self.finished[reason] += 1
            if out.finished:
                self.deadlines.pop(rid, None)
        if deltas:
            self.outbox.put_deltas(deltas)

    # ---- stats and logs ---------------------------------------------------------------

    def stats(self) -> dict:
        e = self.engine
        bm, sched = e.block_manager, e.scheduler
        return {
            "num_requests_running": len(sched.running),
            "num_requests_waiting": len(sched.waiting),
            "kv_cache_usage": 1.0 - bm.num_free_blocks / bm.num_blocks,
            "num_kv_blocks": bm.num_blocks,
            "num_free_kv_blocks": bm.num_free_blocks,
            "prefix_cache_queries": sched.prefix_queries,
            "prefix_cache_hits": sched.prefix_hits,
            "num_preemptions": sched.num_preemptions,
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": e.num_generated_tokens,
            "finished": dict(self.finished),
            "tokens_per_s": self._rate(),
        }

    def _rate(self) -> float:
        dt = time.monotonic() - self._last_log
        return (self.engine.num_generated_tokens - self._last_gen) / dt if dt > 0 else 0.0

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._last_log < self.log_interval:
            return
        s = self.stats()
        if s["num_requests_running"] or s["num_requests_waiting"] or s["tokens_per_s"]:
            log.info(
                "running %d, waiting %d, KV cache %.1f%% used, generation %.1f tok/s, "
                "preemptions %d", s["num_requests_running"], s["num_requests_waiting"],
                100 * s["kv_cache_usage"], s["tokens_per_s"], s["num_preemptions"])
        self._last_log, self._last_gen = now, self.engine.num_generated_tokens
