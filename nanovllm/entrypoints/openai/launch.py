"""`nanovllm serve`: check the address, start the engine process, wait until it is ready,
serve HTTP (with `--api-server-count`, from several front-end processes: front_ends.py)."""

import asyncio
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from nanovllm.core.errors import ConfigError
from nanovllm.engine import stack_sampler
from nanovllm.engine.engine_proc import freeze_heap
from nanovllm.engine.messages import EngineProcessConfig
from nanovllm.engine.tokenizer import load_tokenizer
from nanovllm.entrypoints.ctrl_c import ctrl_c_kept
from nanovllm.entrypoints.openai.app import build_app
from nanovllm.entrypoints.openai.front_ends import (
    MULTIPROC_ENV,
    listening_sockets,
    remove_metrics_dir,
    start_front_ends,
    stop_front_ends,
    watch_front_ends,
)
from nanovllm.entrypoints.openai.replicas import ReplicaSet
from nanovllm.entrypoints.openai.serving import MAX_N, ServerConfig

log = logging.getLogger("nanovllm.server")

ENGINE_DEATH_GRACE_S = 0.5  # after the engine dies, time for in-flight errors to go out


@dataclass(frozen=True)
class ServerSettings:
    """The HTTP side of `nanovllm serve` (the engine's side is an EngineProcessConfig)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # None: $NANOVLLM_API_KEY, or no key
    served_model_name: str | None = None  # None: the model directory's or file's name
    max_request_bytes: int = 1 << 20
    protect_metrics: bool = False  # /metrics needs the API key too
    data_parallel_size: int = 1  # engine processes behind this front end (replicas.py)
    api_server_count: int = 1  # front-end processes sharing the port (see run_server)
    log_requests: bool = True  # a line per finished request
    # seconds a stop (SIGTERM, Ctrl-C) lets the requests in flight finish before it cancels
    # them (uvicorn's graceful shutdown; --drain-timeout)
    drain_timeout: float = 5.0


def run_server(engine: EngineProcessConfig, server: ServerSettings) -> int:
    """Start the engine process, wait until it is ready, serve HTTP until stopped. Raises
    ConfigError, before loading anything, when host:port cannot be listened on."""
    log.setLevel(logging.INFO)
    held = reserve_address(server.host, server.port)
    try:
        return _serve(engine, server, held)
    finally:
        release(held)


def _serve(engine: EngineProcessConfig, server: ServerSettings,
           held: list[socket.socket]) -> int:
    from nanovllm.model.loader.source import open_model

    tokenizer = load_tokenizer(open_model(engine.model))  # fails fast on a bad path
    if server.data_parallel_size < 1:
        raise ConfigError(f"--data-parallel-size {server.data_parallel_size} is invalid; "
                          "use 1 or more engine processes")
    if server.api_server_count < 1:
        raise ConfigError(f"--api-server-count {server.api_server_count} is invalid; "
                          "use 1 or more front-end processes")
    if not server.drain_timeout >= 0:
        raise ConfigError(f"--drain-timeout {server.drain_timeout} is invalid; use 0 or more "
                          "seconds")
    if server.api_server_count > 1 and not os.environ.get(MULTIPROC_ENV):
        raise ConfigError(f"--api-server-count needs {MULTIPROC_ENV} set before the "
                          "metrics are imported (`nanovllm serve` sets it)")
    n = server.data_parallel_size
    log.info("starting the engine process%s (model %s)",
             f"es ({n}, data parallel)" if n > 1 else "", engine.model or "default")
    client = None
    front_ends: list = []
    try:
        # start-up spawns processes and imports modules, whose finalizers and lock
        # callbacks would drop a Ctrl-C
        with ctrl_c_kept():
            client = ReplicaSet.start(engine, server.data_parallel_size,
                                      server.api_server_count)
            config = server_config(server, engine, client)
            log.info(
                "serving %r (max_model_len %d) on http://%s:%d%s%s",
                config.served_model_name,
                client.info.max_model_len,
                server.host,
                server.port,
                " (API key required)" if config.api_key else "",
                f" with {server.api_server_count} front-end processes"
                if server.api_server_count > 1 else "",
            )
            sockets = None
            release(held)  # uvicorn (or listening_sockets) binds the port from here
            if server.api_server_count > 1:  # a socket each on Linux, else one shared
                sockets = listening_sockets(server.host, server.port, server.api_server_count)
                front_ends = start_front_ends(engine, server, client, sockets[1:])
                for sock in sockets[1:]:  # each front end has its own copy: none left here that
                    if sock is not sockets[0]:  # queues connections no one accepts
                        sock.close()
                sockets = sockets[:1]
            # NANOVLLM_SAMPLE_STACKS: where time goes (the report is rewritten as it runs:
            # uvicorn ends the process by re-raising SIGTERM, past any `finally`)
            stack_sampler.from_env(".front")
            http = http_server(build_app(client, tokenizer, config), server, front_ends)
            died = stop_when_engines_die(client, http)
            if front_ends:
                watch_front_ends(front_ends, http, died)
            freeze_heap()  # started: what is alive now stays (engine_proc.freeze_heap)
        try:
            http.run(sockets=sockets)
        except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled: a clean stop
            pass
    finally:
        stop_front_ends(front_ends, server.drain_timeout)
        if client is not None:
            client.shutdown()
    if died:
        log.error("exiting with status 1: %s", died[0])
        return 1
    return 0


def server_config(server: ServerSettings, engine: EngineProcessConfig, client) -> ServerConfig:
    return ServerConfig(
        served_model_name=server.served_model_name or served_name(engine.model),
        api_key=server.api_key or os.environ.get("NANOVLLM_API_KEY") or None,
        max_request_bytes=server.max_request_bytes,
        max_n=min(MAX_N, client.info.max_num_seqs),
        protect_metrics=server.protect_metrics,
        log_requests=server.log_requests,
    )


def stop_when_engines_die(client, http) -> list[str]:
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


def http_server(app, server: ServerSettings, front_ends: list | None = None):
    """uvicorn's server for `app`; with `front_ends` (the other front-end processes), one
    that passes a stop on to them at once and waits for them as it stops: uvicorn ends a
    stopped process by raising the signal again, past any `finally`, and the engine process
    would go with it while the others still drain their requests."""
    import uvicorn

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


def reserve_address(host: str, port: int) -> list[socket.socket]:
    """Bind every address of `host` at `port` (as uvicorn binds them), without listening, and
    return the sockets: a busy port is a ConfigError before a model loads for minutes, and
    while the engine starts nothing else is handed the port (a tensor-parallel rendezvous
    asks the OS for a free one, which could otherwise be this one, free until uvicorn binds
    it). `release` them just before uvicorn binds."""
    try:
        addresses = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as e:
        raise ConfigError(f"cannot resolve --host {host!r}: {e.strerror}") from None
    held: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in addresses:
            held.append(_bind(family, kind, proto, address, host, port))
    except BaseException:
        release(held)
        raise
    return held


def _bind(family, kind, proto, address, host: str, port: int) -> socket.socket:
    # without SO_REUSEADDR first: no other socket, even one that sets it, may then share the
    # port; with it (as uvicorn binds) where the first fails, e.g. over TIME_WAIT connections
    # a previous server left
    for reuse in (False, True):
        sock = socket.socket(family, kind, proto)
        if reuse:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        try:
            sock.bind(address)
            return sock
        except OSError as e:
            sock.close()
            error = e
    msg = f"cannot listen on {host}:{port} ({error.strerror}); pick another --port"
    raise ConfigError(msg) from None


def release(held: list[socket.socket]) -> None:
    while held:
        held.pop().close()


def served_name(model: str | None) -> str:
    """The model name clients use: a directory's whole name ("Qwen3-0.6B"), a file's name
    without its extension ("SmolLM2-135M-Instruct.Q4_1" from ".gguf")."""
    if not model:
        return "SmolLM2-135M-Instruct"
    path = Path(model)
    return path.stem if path.is_file() else path.name
