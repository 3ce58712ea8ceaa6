"""The front end's side of the pipe to the engine process, for asyncio."""

import asyncio
import itertools
import logging
import queue
import threading
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from nanovllm.core.errors import NanoVLLMError
from nanovllm.engine.engine_proc import AddRequest, Delta, start_engine
from nanovllm.entrypoints.openai.protocol import APIError

log = logging.getLogger("nanovllm.server")


class EngineDeadError(NanoVLLMError):
    """The engine process has exited or reported a fatal error."""


class EngineClient:
    """Sends requests to the engine process and routes its Deltas to per-request queues.

    Reads happen on the event loop (`add_reader` on the pipe); writes go through one thread,
    so the loop never blocks on a full pipe while the engine is busy writing to us.
    """

    def __init__(self, proc: BaseProcess, conn: Connection, info: dict[str, Any]) -> None:
        self.proc, self.conn, self.info = proc, conn, info
        self.error: str | None = None  # why the engine is gone
        self._queues: dict[str, asyncio.Queue] = {}
        self._acks: dict[str, asyncio.Future] = {}
        self._stats: dict[int, asyncio.Future] = {}
        self._tokens = itertools.count()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="engine-pipe", daemon=True)
        self._sender.start()
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def start(
        cls,
        model: str | None,
        engine_kwargs: dict,
        max_num_waiting: int | None,
        log_interval: float = 10.0,
    ) -> "EngineClient":
        """Spawn the engine and block until it is ready; raises NanoVLLMError if it fails."""
        proc, conn = start_engine(model, engine_kwargs, max_num_waiting, log_interval)
        try:
            while not conn.poll(0.5):
                if not proc.is_alive():
                    raise EngineDeadError(
                        f"the engine process exited (code {proc.exitcode}) before it was ready"
                    )
            msg = conn.recv()
            if msg[0] == "fatal":
                raise EngineDeadError(f"the engine failed to start: {msg[1]}")
            assert msg[0] == "ready", msg
        except BaseException:
            proc.terminate()
            proc.join(5)
            raise
        return cls(proc, conn, msg[1])

    def attach(self) -> None:
        """Start reading replies on the running event loop."""
        self._loop = loop = asyncio.get_running_loop()
        loop.add_reader(self.conn.fileno(), self._on_readable)
        loop.add_reader(self.proc.sentinel, self._on_exit)

    @property
    def alive(self) -> bool:
        return self.error is None and self.proc.is_alive()

    # ---- requests --------------------------------------------------------------------

    async def add(self, req: AddRequest, out: asyncio.Queue) -> None:
        """Queue `req` in the engine; its Deltas (or an EngineDeadError) go to `out`.
        Raises APIError when the engine rejects it (429 when its waiting queue is full)."""
        self._check_alive()
        ack = asyncio.get_running_loop().create_future()
        self._acks[req.request_id] = ack
        self._queues[req.request_id] = out
        self._send(("add", req))
        try:
            reply = await ack
        finally:
            self._acks.pop(req.request_id, None)
        if reply[0] == "rejected":
            self._queues.pop(req.request_id, None)
            _, _, status, message, retry_after = reply
            headers = {"Retry-After": str(retry_after or 1)} if status == 429 else None
            code = "rate_limit_exceeded" if status == 429 else None
            raise APIError(status, message, code=code, headers=headers)

    def release(self, request_id: str, abort: bool) -> None:
        """Stop routing Deltas of `request_id`; with `abort`, also end it in the engine."""
        self._queues.pop(request_id, None)
        if abort and self.error is None:
            self._send(("abort", request_id))

    async def stats(self, timeout: float = 5.0) -> dict[str, Any]:
        """A fresh snapshot of the engine's counters (see the spec's ("stats", ...) reply)."""
        self._check_alive()
        token = next(self._tokens)
        fut = asyncio.get_running_loop().create_future()
        self._stats[token] = fut
        self._send(("stats", token))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._stats.pop(token, None)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._detach()
        if self.proc.is_alive():
            self._send(("shutdown",))
        self._outbox.put(None)
        self.proc.join(timeout)
        if self.proc.is_alive():
            log.warning("the engine process did not exit in %.0f s; terminating it", timeout)
            self.proc.terminate()
            self.proc.join(5)

    # ---- the pipe --------------------------------------------------------------------

    def _detach(self) -> None:
        """Stop watching the pipe and the process on the event loop."""
        if self._loop is not None and not self._loop.is_closed():
            for fd in (self.conn.fileno(), self.proc.sentinel):
                self._loop.remove_reader(fd)

    def _check_alive(self) -> None:
        if not self.alive:
            raise EngineDeadError(self.error or "the engine process has exited")

    def _send(self, msg: tuple) -> None:
        self._outbox.put(msg)

    def _send_loop(self) -> None:
        while (msg := self._outbox.get()) is not None:
            try:
                self.conn.send(msg)
            except (OSError, ValueError):  # the engine is gone; the reader reports it
                return

    def _on_readable(self) -> None:
        try:
            # a bounded batch: a fast engine keeps the pipe readable, and an unbounded loop
            # here would starve the HTTP side of the event loop (the reader fires again)
            for _ in range(32):
                self._dispatch(self.conn.recv())
                if not self.conn.poll():
                    break
        except (EOFError, OSError):
            self._fail("the engine process closed its pipe")

    def _on_exit(self) -> None:
        self.proc.join(1)  # the sentinel fires as it exits: reap it for the exit code
        code = self.proc.exitcode
        how = f"was killed by signal {-code}" if code and code < 0 else f"exited (code {code})"
        # a stop by Ctrl-C or SIGTERM reaches the engine too: not an error then
        self._fail(f"the engine process {how}", orderly=code in (0, -2, -15))

    def _dispatch(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "out":
            deltas: list[Delta] = msg[1]
            for d in deltas:
                q = self._queues.get(d.request_id)
                if q is not None:
                    q.put_nowait(d)
        elif kind in ("accepted", "rejected"):
            ack = self._acks.get(msg[1])
            if ack is not None and not ack.done():
                ack.set_result(msg)
        elif kind == "stats":
            fut = self._stats.get(msg[1])
            if fut is not None and not fut.done():
                fut.set_result(msg[2])
        elif kind == "fatal":
            self._fail(f"the engine failed: {msg[1]}")
        else:
            log.warning("unexpected message from the engine: %r", kind)

    def _fail(self, reason: str, orderly: bool = False) -> None:
        """The engine is gone: wake every waiter with an EngineDeadError."""
        if self.error is not None:
            return
        self.error = reason
        level = logging.WARNING if orderly else logging.ERROR
        log.log(level, "%s; /health now fails and new requests get 503", reason)
        self._detach()
        err = EngineDeadError(reason)
        for fut in [*self._acks.values(), *self._stats.values()]:
            if not fut.done():
                fut.set_exception(err)
        for q in self._queues.values():
            q.put_nowait(err)
        self._queues.clear()
