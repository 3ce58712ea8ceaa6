"""The engine process's loop (`EngineLoop`): steps the engine while it has work, and between
steps takes the front ends' messages (requests, aborts, stats queries), expires timeouts,
sends each step's outputs through an `Outbox` per front end, the Load reports and the
periodic status line. How the process starts and what it promises: engine_proc.py.
"""

import logging
import math
import select
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection

from nanovllm.core.errors import InvalidRequestError, NanoVLLMError
from nanovllm.core.sequence import FinishReason
from nanovllm.engine.messages import (
    AbortRequest,
    Accepted,
    AddRequest,
    DeltaRow,
    EngineProcessConfig,
    EngineStats,
    FrontEndMessage,
    Load,
    Rejected,
    RejectReason,
    Shutdown,
    StatsQuery,
    StatsReply,
)
from nanovllm.engine.outbox import Outbox
from nanovllm.engine.step_times import GcPauses, StepTimes

log = logging.getLogger("nanovllm.engine")

# seconds between the Load reports a working engine sends every front end (placement across
# data-parallel replicas reads them): ~100 a second, a few dozen bytes each
LOAD_INTERVAL = 0.01


class EngineLoop:
    """Steps the engine while it has work, and between steps serves the front end's
    messages, request timeouts and the periodic status line."""

    def __init__(self, engine, conns: list[Connection], config: EngineProcessConfig) -> None:
        self.engine = engine
        self.conns = conns
        self.outboxes = [Outbox(c) for c in conns]
        self.origin: dict[str, int] = {}  # request id -> the front end that sent it
        self.max_num_waiting = config.max_num_waiting
        self.log_interval = config.log_interval
        self.deadlines: dict[str, float] = {}
        self.finished: dict[str, int] = {r.value: 0 for r in FinishReason}
        self.running = True
        self._last_log = time.monotonic()
        self._last_gen = 0
        self.prompt_tokens = 0  # of accepted requests
        self._finish_times: deque[float] = deque()  # completions ended, for retry_after
        self.times = StepTimes(("idle", "receive", "send"))  # between steps (EngineStats)
        self.gc_pauses = GcPauses()
        self.gc_frozen_objects = 0  # run_engine_loop sets it (freeze_heap)
        self.adds_seen = [0] * len(conns)  # AddRequests taken, per front end (Load)
        self._load_due = False  # the queues changed since the last Load
        self._last_load = 0.0
        # one poll set for the loop's life: Connection.poll and connection.wait build a
        # selector on every call (tens of us, paid between every two steps)
        # requests whose constraint compiles in the background (one thread), answered
        # Accepted or Rejected when it is done: a cold compile (up to ~100 ms within the
        # grammar engine's limits) does not stall the running requests' steps
        self.compiling: dict[str, tuple[AddRequest, int, Future]] = {}
        self._compiler: ThreadPoolExecutor | None = None
        self._poller = select.poll()
        self._fd_index = {}
        for i, c in enumerate(conns):
            self._poller.register(c.fileno(), select.POLLIN)
            self._fd_index[c.fileno()] = i

    # ---- the loop ---------------------------------------------------------------------

    def run(self) -> None:
        engine, outboxes, conns = self.engine, self.outboxes, self.conns
        while self.running:
            start = time.perf_counter()
            busy = engine.has_unfinished_requests()
            # between steps, take everything that arrived; when idle, sleep on the pipes (in
            # short naps while Deltas wait for a front end to make room for them)
            timeout = 0.0 if busy else self._idle_timeout()
            if any(o.pending for o in outboxes) or self.compiling:
                timeout = min(timeout, 0.002)
            # the time so far is counted before each message, so a StatsReply includes it
            phase = "receive" if busy else "idle"
            while ready := self._readable(timeout):
                start = self._count(phase, start)
                for i in ready:
                    self._handle(conns[i].recv(), i)
                timeout = 0.0
            self._count(phase, start)
            if self.compiling:
                self._admit_compiled()
            self._expire()
            rows = done = None
            if engine.has_unfinished_requests():
                rows, done = engine.step_delta_rows()
                self._load_due = True
            with self.times("send"):
                if rows or done:
                    self._send_outputs(rows, done)
                if self._load_due:
                    self._maybe_send_load()
                for outbox in outboxes:
                    if outbox.pending:
                        outbox.flush()
            self._maybe_log()
        for rid, (_, origin, _) in self.compiling.items():
            self.outboxes[origin].send(Rejected(
                rid, RejectReason.OVERLOADED, "the engine is shutting down; retry elsewhere"))
        if self._compiler is not None:
            self._compiler.shutdown(wait=False, cancel_futures=True)
        for outbox in outboxes:
            outbox.flush(timeout=1.0)

    def _readable(self, timeout: float) -> list[int]:
        """The front ends (indices) whose pipes have a message or have closed, waiting up to
        `timeout` seconds for one."""
        return [self._fd_index[fd] for fd, _ in self._poller.poll(timeout * 1000)]

    def _count(self, phase: str, start: float) -> float:
        """Add the time since `start` to `phase`; returns now."""
        now = time.perf_counter()
        self.times.totals[phase] += now - start
        return now

    def _idle_timeout(self) -> float:
        now = time.monotonic()
        wake = self._last_log + self.log_interval
        if self.deadlines:
            wake = min(wake, min(self.deadlines.values()))
        return max(0.0, min(wake - now, 1.0))

    def _maybe_send_load(self) -> None:
        """Every front end gets the engine's Load at most every LOAD_INTERVAL seconds while
        it works, and at once when it is idle (the last word until it works again)."""
        now = time.monotonic()
        busy = self.engine.has_unfinished_requests()
        if busy and now - self._last_load < LOAD_INTERVAL:
            return
        self._load_due, self._last_load = False, now
        sched = self.engine.scheduler
        waiting, running = len(sched.waiting), len(sched.running)
        free = self.engine.block_manager.num_free_blocks
        for outbox, seen in zip(self.outboxes, self.adds_seen):
            outbox.put_load(Load(waiting, running, free, seen))

    def _handle(self, msg: FrontEndMessage, origin: int) -> None:
        match msg:
            case AddRequest():
                self.adds_seen[origin] += 1
                self._load_due = True
                self._add(msg, origin)
            case AbortRequest(request_id=rid):
                if self.compiling.pop(rid, None) is None:  # a compiling one: never queued
                    self._finish(rid, FinishReason.ABORT, notify=False)
            case StatsQuery(token=token):
                self.outboxes[origin].send(StatsReply(token, self.stats()))
            case Shutdown():
                self.running = False
            case _:
                log.warning("unexpected message from the front end: %r", msg)

    def _add(self, req: AddRequest, origin: int) -> None:
        engine, rid, outbox = self.engine, req.request_id, self.outboxes[origin]
        waiting = len(engine.scheduler.waiting) + len(self.compiling)
        if self.max_num_waiting is not None and waiting >= self.max_num_waiting:
            retry = self._retry_after(waiting)
            msg = (f"the server is at capacity ({waiting} requests waiting, "
                   f"--max-num-waiting {self.max_num_waiting}); retry in {retry} s")
            outbox.send(Rejected(rid, RejectReason.OVERLOADED, msg, retry_after=retry))
            return
        constraint = req.params.structured_outputs
        try:  # the engine checks the ids (vocabulary, empty, longer than the context)
            if constraint is not None and self._compile_first(req, origin, constraint):
                return
            engine.add_request(req.prompt_token_ids, req.params, rid, stream=req.stream,
                               priority=req.priority, delta=True, detokenize=req.detokenize)
        except InvalidRequestError as e:
            outbox.send(Rejected(rid, RejectReason.INVALID, str(e), e.param, e.code))
            return
        except NanoVLLMError as e:  # e.g. a ConfigError: no request field to name
            outbox.send(Rejected(rid, RejectReason.INVALID, str(e)))
            return
        if len(self.outboxes) > 1:
            self.origin[rid] = origin
        self.prompt_tokens += len(req.prompt_token_ids)
        if req.timeout is not None:
            self.deadlines[rid] = time.monotonic() + req.timeout
        outbox.send(Accepted(rid))

    def _compile_first(self, req: AddRequest, origin: int, constraint) -> bool:
        """True when `req`'s constraint is not compiled yet: it compiles in the background,
        and `_admit_compiled` adds the request once it has."""
        grammars = self.engine.structured.grammars  # a ConfigError here rejects at once
        if grammars.is_cached(constraint):
            return False
        if self._compiler is None:
            self._compiler = ThreadPoolExecutor(1, thread_name_prefix="nanovllm-grammar")
        self.compiling[req.request_id] = (req, origin,
                                          self._compiler.submit(grammars.compile, constraint))
        return True

    def _admit_compiled(self) -> None:
        """Requests whose constraint finished compiling: added now (the compiled matcher is
        in the cache), or rejected with the compile error."""
        for rid in [r for r, (_, _, f) in self.compiling.items() if f.done()]:
            req, origin, future = self.compiling.pop(rid)
            e = future.exception()
            if isinstance(e, InvalidRequestError):
                self.outboxes[origin].send(
                    Rejected(rid, RejectReason.INVALID, str(e), e.param, e.code))
            elif e is not None:  # Grammars.compile turns what it knows into the above
                log.error("compiling the constraint of %s failed", rid, exc_info=e)
                self.outboxes[origin].send(Rejected(
                    rid, RejectReason.INVALID, "the constraint could not be compiled",
                    "structured_outputs"))
            else:
                self._add(req, origin)

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
        self._load_due = True  # an abort or a timeout: the queues may be shorter
        out = self.engine.finish_request(rid, reason)
        self.deadlines.pop(rid, None)
        if out is None:
            return
        for o in out.outputs:
            if o.finish_reason == reason.value:
                self.finished[reason.value] += 1
        if notify:
            self._send_outputs([(rid, o.index, o.text, o.token_ids, o.logprobs, o.finish_reason,
                                 o.stop_reason, out.num_cached_tokens, out.queue_time)
                                for o in out.outputs], [rid])
        self.origin.pop(rid, None)

    # ---- outputs ----------------------------------------------------------------------

    def _send_outputs(self, rows: list[DeltaRow], done: list[str]) -> None:
        """Completions that moved (rows of Delta's fields, LLMEngine.step_delta_rows), each
        to the front end that sent its request; `done`: the requests that finished."""
        now = None
        for row in rows:
            reason = row[5]
            if reason is not None:  # a completion ended
                now = now or time.monotonic()
                self._finish_times.append(now)
                if reason in ("stop", "length"):
                    self.finished[reason] += 1
        for rid in done:
            self.deadlines.pop(rid, None)
        if len(self.outboxes) == 1:
            if rows:
                self.outboxes[0].put_deltas(rows)
            return
        by_origin: dict[int, list[DeltaRow]] = {}
        origin = self.origin
        for row in rows:
            by_origin.setdefault(origin.get(row[0], 0), []).append(row)
        for rid in done:
            origin.pop(rid, None)
        for i, group in by_origin.items():
            self.outboxes[i].put_deltas(group)

    # ---- stats and logs ---------------------------------------------------------------

    def stats(self) -> EngineStats:
        """A snapshot of the queues, the KV cache and the counters."""
        e = self.engine
        bm, sched = e.block_manager, e.scheduler
        return EngineStats(
            num_requests_running=len(sched.running),
            num_requests_waiting=len(sched.waiting),
            kv_cache_usage=1.0 - bm.num_free_blocks / bm.num_blocks,
            num_kv_blocks=bm.num_blocks,
            num_free_kv_blocks=bm.num_free_blocks,
            prefix_cache_queries=sched.prefix_queries,
            prefix_cache_hits=sched.prefix_hits,
            num_preemptions=sched.num_preemptions,
            num_swaps=sched.num_swaps,
            num_host_kv_blocks=bm.host.num_blocks if bm.host else 0,
            num_free_host_kv_blocks=len(bm.host.free) if bm.host else 0,
            kv_block_events=dict(bm.events),
            prompt_tokens=self.prompt_tokens,
            generation_tokens=e.num_generated_tokens,
            finished=dict(self.finished),
            tokens_per_s=self._rate(),
            num_steps=e.num_steps,
            num_prefill_steps=e.num_prefill_steps,
            loop_seconds={**self.times.totals, **e.timing},
            gc_seconds=dict(self.gc_pauses.totals),
            gc_frozen_objects=self.gc_frozen_objects,
        )

    def _rate(self) -> float:
        dt = time.monotonic() - self._last_log
        return (self.engine.num_generated_tokens - self._last_gen) / dt if dt > 0 else 0.0

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._last_log < self.log_interval:
            return
        s = self.stats()
        if s.num_requests_running or s.num_requests_waiting or s.tokens_per_s:
            log.info(
                "running %d, waiting %d, KV cache %.1f%% used, generation %.1f tok/s, "
                "preemptions %d", s.num_requests_running, s.num_requests_waiting,
                100 * s.kv_cache_usage, s.tokens_per_s, s.num_preemptions)
        self._last_log, self._last_gen = now, self.engine.num_generated_tokens
