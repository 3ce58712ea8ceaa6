"""The front end's side of the pipe to the engine process, for asyncio."""

import asyncio
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path

from nanovllm.core.errors import NanoVLLMError
from nanovllm.engine.engine_proc import start_engine
from nanovllm.engine.messages import (
    AbortRequest,
    Accepted,
    AddRequest,
    EngineInfo,
    EngineMessage,
    EngineProcessConfig,
    EngineStats,
    Fatal,
    FrontEndMessage,
    Load,
    Outputs,
    Ready,
    Rejected,
    Shutdown,
    StatsQuery,
    StatsReply,
)

log = logging.getLogger("nanovllm.server")


class EngineDeadError(NanoVLLMError):
    """The engine process has exited or reported a fatal error."""


class RequestRejected(NanoVLLMError):
    """The engine did not queue a request; `rejection` says why (the front end maps its
    reason to an HTTP status)."""

    def __init__(self, rejection: Rejected) -> None:
        super().__init__(rejection.message)
        self.rejection = rejection


class EngineClient:
    """Sends requests to the engine process and routes its Deltas to per-request queues.

    The pipe is served by two threads with blocking I/O, one writing and one reading; the
    reader hands what it reads to the event loop in batches. Nothing registers the pipe with
    the event loop: uvloop (which uvicorn picks when it is installed) makes a watched fd
    non-blocking, and a blocking `Connection` on a non-blocking fd fails with EAGAIN as soon
    as the pipe fills (a burst of long prompts while the engine steps).
    """

    def __init__(self, proc: "BaseProcess | PeerProcess", conn: Connection, info: EngineInfo,
                 spare_conns: list[Connection] | None = None) -> None:
        self.proc, self.conn, self.info = proc, conn, info
        # the engine's pipes to the other front-end processes (--api-server-count), handed
        # to them by front_ends.py; the engine process is this client's to stop
        self.spare_conns = spare_conns or []
        self.owner = isinstance(proc, BaseProcess)
        self.error: str | None = None  # why the engine is gone
        self._queues: dict[str, asyncio.Queue] = {}
        self._acks: dict[str, asyncio.Future[Accepted | Rejected]] = {}
        self._stats: dict[int, asyncio.Future[EngineStats]] = {}
        self._tokens = itertools.count()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="engine-send", daemon=True)
        self._sender.start()
        self._loop: asyncio.AbstractEventLoop | None = None
        # placement's view of the engine (replicas.py): its last Load, and the AddRequests
        # sent so far (those beyond the Load's adds_seen are not in it yet)
        self.load: Load | None = None
        self.sent_adds = 0
        # called once, on the event loop, when the engine is gone (front_ends.py stops the server)
        self.on_death: Callable[[str], None] | None = None

    @classmethod
    def start(cls, config: EngineProcessConfig, num_front_ends: int = 1) -> "EngineClient":
        """Spawn the engine and block until it is ready; raises NanoVLLMError if it fails.
        With several front-end processes, the engine gets a pipe to each; this client
        keeps the others' in `spare_conns`."""
        proc, conns = start_engine(config, num_front_ends)
        try:
            info = _ready(conns[0], proc)
        except BaseException:
            proc.kill()  # it ignores SIGTERM (run_engine_loop)
            proc.join(5)
            raise
        return cls(proc, conns[0], info, conns[1:])

    @classmethod
    def connect(cls, conn: Connection, pid: int) -> "EngineClient":
        """In another front-end process: the client of a running engine (process `pid`,
        started by the first front end) over its pipe `conn`."""
        return cls(PeerProcess(pid), conn, _ready(conn, PeerProcess(pid)))

    def attach(self) -> None:
        """Start routing the engine's replies to the running event loop."""
        self._loop = asyncio.get_running_loop()
        threading.Thread(target=self._recv_loop, name="engine-recv", daemon=True).start()

    @property
    def alive(self) -> bool:
        return self.error is None and self.proc.is_alive()

    # ---- requests --------------------------------------------------------------------

    async def add(self, req: AddRequest, out: asyncio.Queue) -> None:
        """Queue `req` in the engine; its Deltas (or an EngineDeadError) go to `out`.
        Raises RequestRejected when the engine refuses it."""
        self._check_alive()
        ack = asyncio.get_running_loop().create_future()
        self._acks[req.request_id] = ack
        self._queues[req.request_id] = out
        self.sent_adds += 1
        self._send(req)
        try:
            reply = await ack
        finally:
            self._acks.pop(req.request_id, None)
        if isinstance(reply, Rejected):
            self._queues.pop(req.request_id, None)
            raise RequestRejected(reply)

    def release(self, request_id: str, abort: bool) -> None:
        """Stop routing Deltas of `request_id`; with `abort`, also end it in the engine."""
        self._queues.pop(request_id, None)
        if abort and self.error is None:
            self._send(AbortRequest(request_id))

    async def stats(self, timeout: float = 5.0) -> EngineStats:
        """A fresh snapshot of the engine's queues, KV cache and counters."""
        self._check_alive()
        token = next(self._tokens)
        fut = asyncio.get_running_loop().create_future()
        self._stats[token] = fut
        self._send(StatsQuery(token))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._stats.pop(token, None)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._loop = None  # the reader stops handing replies over
        if not self.owner:  # another front end's engine: its owner stops it
            self._outbox.put(None)
            return
        if self.proc.is_alive():
            self._send(Shutdown())
        self._outbox.put(None)
        self.proc.join(timeout)
        if self.proc.is_alive():  # it ignores SIGTERM (run_engine_loop)
            log.warning("the engine process did not exit in %.0f s; killing it", timeout)
            self.proc.kill()
            self.proc.join(5)

    # ---- the pipe --------------------------------------------------------------------

    def _check_alive(self) -> None:
        if not self.alive:
            raise EngineDeadError(self.error or "the engine process has exited")

    def _send(self, msg: FrontEndMessage) -> None:
        self._outbox.put(msg)

    def _send_loop(self) -> None:
        while (msg := self._outbox.get()) is not None:
            try:
                self.conn.send(msg)
            except (OSError, ValueError):  # the engine is gone; the reader reports it
                return
            except Exception as e:  # never die silently: every waiter would hang
                log.exception("cannot send to the engine")
                self._call(self._fail, f"cannot send to the engine: {type(e).__name__}: {e}")
                return

    def _recv_loop(self) -> None:
        """Read until the engine closes its end; hand over what is ready in one callback, so
        a fast engine costs the event loop one wake-up per batch, not per message."""
        try:
            while True:
                batch = [self.conn.recv()]
                while len(batch) < 64 and self.conn.poll():
                    batch.append(self.conn.recv())
                if not self._call(self._dispatch_all, batch):
                    return
        except (EOFError, OSError):
            pass
        self.proc.join(5)  # it closed the pipe: reap it for the exit code
        code = self.proc.exitcode
        if code is None:
            how = "closed its pipe"
        elif code < 0:
            how = f"was killed by signal {-code}"
        else:
            how = f"exited (code {code})"
        # a stop by Ctrl-C or SIGTERM reaches the engine too: not an error then
        self._call(self._fail, f"the engine process {how}", code in (0, -2, -15))

    def _call(self, fn, *args) -> bool:
        """Run fn(*args) on the event loop, from another thread; False once it is gone."""
        loop = self._loop
        if loop is None:
            return False
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed
            return False
        return True

    def _dispatch_all(self, msgs: list[EngineMessage]) -> None:
        for msg in msgs:
            self._dispatch(msg)

    def _dispatch(self, msg: EngineMessage) -> None:
        match msg:
            case Outputs(deltas=deltas):
                queues = self._queues
                for d in deltas:
                    q = queues.get(d.request_id)
                    if q is not None:
                        q.put_nowait(d)
            case Load():
                self.load = msg
            case Accepted(request_id=rid) | Rejected(request_id=rid):
                ack = self._acks.get(rid)
                if ack is not None and not ack.done():
                    ack.set_result(msg)
            case StatsReply(token=token, stats=stats):
                fut = self._stats.get(token)
                if fut is not None and not fut.done():
                    fut.set_result(stats)
            case Fatal(message=message):
                self._fail(f"the engine failed: {message}")
            case _:
                log.warning("unexpected message from the engine: %r", msg)

    def _fail(self, reason: str, orderly: bool = False) -> None:
        """The engine is gone: wake every waiter with an EngineDeadError."""
        if self.error is not None:
            return
        self.error = reason
        level = logging.WARNING if orderly else logging.ERROR
        log.log(level, "%s; requests in flight end with an error, new ones get 503", reason)
        err = EngineDeadError(reason)
        for fut in [*self._acks.values(), *self._stats.values()]:
            if not fut.done():
                fut.set_exception(err)
        for q in self._queues.values():
            q.put_nowait(err)
        self._queues.clear()
        if self.on_death is not None:
            self.on_death(reason)


def _ready(conn: Connection, proc) -> EngineInfo:
    """The engine's first message on `conn`: its EngineInfo, or why it did not start."""
    while not conn.poll(0.5):
        if not proc.is_alive():
            raise EngineDeadError(
                f"the engine process exited (code {proc.exitcode}) before it was ready"
            )
    match conn.recv():
        case Ready(info=info):
            return info
        case Fatal(message=message):
            raise EngineDeadError(f"the engine failed to start: {message}")
        case other:
            raise EngineDeadError(f"the engine started with {other!r}, not Ready")


class PeerProcess:
    """An engine process another front-end process started: as much of multiprocessing's
    Process as EngineClient uses (alive, join); its exit code is its parent's to read."""

    exitcode = None

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def is_alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        try:  # where /proc says so: a zombie has exited (its parent has not reaped it yet)
            state = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        return state not in ("Z", "X")

    def join(self, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        while self.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
