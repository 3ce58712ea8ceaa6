"""Front-end processes: each serves the app over HTTP (uvicorn) until a stop or the engines'
death. The first (launch.py) starts the engines and, with `--api-server-count N`, spawns
front ends 1..N-1 here.

One process streams every token of every request: HTTP, JSON, detokenizing, SSE. With
several engine replicas that can be more than a core's worth. The first front end binds the
sockets (sockets.listening_sockets: one per front end on the same port, on Linux) and each
other front end gets its own pipe to every engine process (the engine loop serves them all,
replying on the pipe a request came from). A front end that exits takes the server down: its
pipes close, the engines stop, and every front end exits with status 1, as when an engine
dies. Their latency histograms are shared through prometheus_client's multiprocess files
(metrics.py, metrics_dir.py).
"""

import asyncio
import logging
import multiprocessing
import sys
import threading
from multiprocessing.connection import wait

import uvicorn

from nanovllm.engine.engine_proc import freeze_heap
from nanovllm.engine.messages import EngineProcessConfig
from nanovllm.engine.tokenizer import load_tokenizer
from nanovllm.entrypoints.openai.app import build_app
from nanovllm.entrypoints.openai.metrics_dir import remove_metrics_dir
from nanovllm.entrypoints.openai.replicas import ReplicaSet
from nanovllm.entrypoints.openai.serving import ServerSettings
from nanovllm.model.loader.source import open_model

log = logging.getLogger("nanovllm.server")

ENGINE_DEATH_GRACE_S = 0.5  # after the engine dies, time for in-flight errors to go out


def http_server(app, server: ServerSettings, front_ends: list | None = None) -> uvicorn.Server:
    """uvicorn's server for `app`; with `front_ends` (the other front-end processes), one
    that passes a stop on to them at once and waits for them as it stops: uvicorn ends a
    stopped process by raising the signal again, past any `finally`, and the engine process
    would go with it while the others still drain their requests."""

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            for p in front_ends or ():
                if p.is_alive():
                    p.terminate()  # SIGTERM: they drain their requests as this one does
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets=None) -> None:
            await super().shutdown(sockets)
            if front_ends:
                await asyncio.to_thread(stop_front_ends, front_ends, server.drain_timeout)
                remove_metrics_dir()  # here: a stop by signal skips `nanovllm serve`'s own

    # per-request log lines replace uvicorn's access log
    return Server(uvicorn.Config(
        app, host=server.host, port=server.port, access_log=False,
        timeout_graceful_shutdown=server.drain_timeout,
    ))  # fmt: skip


def stop_when_engines_die(client: ReplicaSet, http: uvicorn.Server) -> list[str]:
    """Once the last engine is gone, stop `http` (after ENGINE_DEATH_GRACE_S, so the failed
    requests' answers go out); returns the list the reason lands in. No zombie server: the
    caller exits non-zero so a supervisor (systemd, Kubernetes, a router) starts a fresh
    one."""
    died: list[str] = []

    def on_death(reason: str) -> None:
        if http.should_exit:  # stopping already (Ctrl-C, SIGTERM): the engine went too
            return
        died.append(reason)
        asyncio.get_running_loop().call_later(ENGINE_DEATH_GRACE_S, setattr, http,
                                              "should_exit", True)

    client.on_death = on_death
    return died


def start_front_ends(engine: EngineProcessConfig, server: ServerSettings, client: ReplicaSet,
                     socks: list) -> list:
    """Spawn front ends 1..N-1 (`server.api_server_count` in all), front end k on
    `socks[k - 1]`, each with its pipes to `client`'s engines; this process keeps none of
    theirs."""
    ctx = multiprocessing.get_context("spawn")
    procs = []
    for k in range(1, server.api_server_count):
        proc = ctx.Process(target=run_front_end, name=f"nanovllm-front-end-{k}", daemon=False,
                           args=(engine, server, client.front_end_pipes(k), socks[k - 1]))
        proc.start()
        log.info("front end %d: process %d", k, proc.pid)
        procs.append(proc)
    client.close_spare_pipes()
    return procs


def watch_front_ends(procs: list, http: uvicorn.Server, died: list[str]) -> None:
    """Stop this front end (status 1) when another exits while the server runs."""

    def watch() -> None:
        wait([p.sentinel for p in procs])
        if not http.should_exit and not died:  # (an engine's death is being handled)
            gone = next(p for p in procs if not p.is_alive())
            died.append(f"front end process {gone.pid} exited (code {gone.exitcode})")
            http.should_exit = True

    threading.Thread(target=watch, name="front-end-watch", daemon=True).start()


def stop_front_ends(procs: list, drain_timeout: float) -> None:
    """SIGTERM each (uvicorn's graceful stop); SIGKILL what still runs 5 s past its drain."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(drain_timeout + 5)
        if p.is_alive():
            p.kill()
            p.join()


def run_front_end(engine: EngineProcessConfig, server: ServerSettings, pipes: list, sock) -> None:
    """Another front end's process: the replicas over its pipes, the app, HTTP on `sock`; exits
    with status 1 when the engines are gone. `server` comes resolved (launch.resolved)."""
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)
    client = ReplicaSet.connect(pipes)
    app = build_app(client, load_tokenizer(open_model(engine.model)), server)
    http = http_server(app, server)
    died = stop_when_engines_die(client, http)
    freeze_heap()  # started: what is alive now stays (engine_proc.freeze_heap)
    try:
        http.run(sockets=[sock])
    finally:
        client.shutdown()
    sys.exit(1 if died else 0)
