"""Several front-end processes for one server (`nanovllm serve --api-server-count N`).

One process streams every token of every request: HTTP, JSON, detokenizing, SSE. With
several engine replicas that can be more than a core's worth. The first front end
(launch.py) binds the sockets (`listening_sockets`: one per front end on the same port, on
Linux) and spawns front ends 1..N-1 here, each with its own pipe to every engine process (the
engine loop serves them all, replying on the pipe a request came from). A front end
that exits takes the server down: its pipes close, the engines stop, and every front end
exits with status 1, as when an engine dies. Their latency histograms are shared through
prometheus_client's multiprocess files (metrics.py), in a directory `nanovllm serve` makes
(make_metrics_dir) before prometheus_client is first imported, which is why this module
does not import it.
"""

import logging
import multiprocessing
import os
import shutil
import socket
import sys
import tempfile
import threading
from multiprocessing.connection import wait

from nanovllm.core.errors import ConfigError
from nanovllm.engine.engine_proc import freeze_heap
from nanovllm.engine.messages import EngineProcessConfig

log = logging.getLogger("nanovllm.server")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # where prometheus_client's processes share files
METRICS_DIR_PREFIX = "nanovllm-metrics-"  # the shared metrics' directory nanovllm serve makes


def listening_sockets(host: str, port: int, n: int) -> list[socket.socket]:
    """A bound socket for each of `n` front ends. On Linux each has its own, all on one port
    with SO_REUSEPORT, and the kernel spreads new connections over them evenly (by address
    hash). One shared socket, used elsewhere, lets whichever process wakes first take the
    queue (asyncio accepts up to 100 connections a wakeup): in a test here 512 connections at
    once split 127 / 385 over two processes, against 260 / 252 with SO_REUSEPORT. A port
    taken since reserve_address released it is a ConfigError."""
    own = n > 1 and sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn binds
    socks: list[socket.socket] = []
    try:
        for _ in range(n if own else 1):
            sock = socket.socket(family, socket.SOCK_STREAM)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if own:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            try:
                sock.bind((host, port))
            except OSError as e:
                raise ConfigError(f"cannot listen on {host}:{port} ({e.strerror}); pick "
                                  "another --port") from None
            port = sock.getsockname()[1]  # port 0: the others join the port it got
            sock.set_inheritable(True)
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks if own else socks * n


def start_front_ends(engine: EngineProcessConfig, server, client, socks: list) -> list:
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


def watch_front_ends(procs: list, http, died: list[str]) -> None:
    """Stop this front end (status 1) when another exits while the server runs."""

    def watch() -> None:
        wait([p.sentinel for p in procs])
        if not http.should_exit and not died:  # (an engine's death is being handled)
            gone = next(p for p in procs if not p.is_alive())
            died.append(f"front end process {gone.pid} exited (code {gone.exitcode})")
            http.should_exit = True

    threading.Thread(target=watch, name="front-end-watch", daemon=True).start()


def make_metrics_dir() -> None:
    """A directory for the front ends' shared metrics, unless the user named one; to be
    called before prometheus_client is first imported (it reads MULTIPROC_ENV then)."""
    if not os.environ.get(MULTIPROC_ENV):
        os.environ[MULTIPROC_ENV] = tempfile.mkdtemp(prefix=METRICS_DIR_PREFIX)


def remove_metrics_dir() -> None:
    """The shared metrics' files, once every front end has stopped: only a directory
    `nanovllm serve` made (METRICS_DIR_PREFIX), never one the user named."""
    path = os.environ.get(MULTIPROC_ENV, "")
    if os.path.basename(path).startswith(METRICS_DIR_PREFIX):
        shutil.rmtree(path, ignore_errors=True)


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


def run_front_end(engine: EngineProcessConfig, server, pipes: list, sock) -> None:
    """Another front end's process: the replicas over its pipes, the app, HTTP on `sock`; exits
    with status 1 when the engines are gone."""
    from nanovllm.engine.tokenizer import load_tokenizer
    from nanovllm.entrypoints.openai import launch  # which imports this module
    from nanovllm.entrypoints.openai.app import build_app
    from nanovllm.entrypoints.openai.replicas import ReplicaSet
    from nanovllm.model.loader.source import open_model

    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)
    client = ReplicaSet.connect(pipes)
    app = build_app(client, load_tokenizer(open_model(engine.model)),
                    launch.server_config(server, engine, client))
    http = launch.http_server(app, server)
    died = launch.stop_when_engines_die(client, http)
    freeze_heap()  # started: what is alive now stays (engine_proc.freeze_heap)
    try:
        http.run(sockets=[sock])
    finally:
        client.shutdown()
    sys.exit(1 if died else 0)
