"""`nanovllm serve`: check the settings and the address, start the engine processes, wait
until they are ready, serve HTTP from this process (and, with `--api-server-count`, from the
other front-end processes: front_ends.py) until stopped."""

import dataclasses
import logging
import os
import socket
from pathlib import Path

from nanovllm.core.errors import ConfigError
from nanovllm.engine.engine_proc import freeze_heap
from nanovllm.engine.messages import EngineProcessConfig
from nanovllm.engine.tokenizer import load_tokenizer
from nanovllm.entrypoints.ctrl_c import ctrl_c_kept
from nanovllm.entrypoints.openai.app import build_app
from nanovllm.entrypoints.openai.front_ends import (
    http_server,
    start_front_ends,
    stop_front_ends,
    stop_when_engines_die,
    watch_front_ends,
)
from nanovllm.entrypoints.openai.metrics_dir import MULTIPROC_ENV
from nanovllm.entrypoints.openai.replicas import ReplicaSet
from nanovllm.entrypoints.openai.serving import ServerSettings
from nanovllm.entrypoints.openai.sockets import listening_sockets, release, reserve_address
from nanovllm.model.loader.source import open_model

log = logging.getLogger("nanovllm.server")


def run_server(engine: EngineProcessConfig, server: ServerSettings) -> int:
    """Start the engine process, wait until it is ready, serve HTTP until stopped. Raises
    ConfigError, before loading anything, when host:port cannot be listened on."""
    log.setLevel(logging.INFO)
    held = reserve_address(server.host, server.port)
    try:
        return _serve(engine, resolved(server, engine.model), held)
    finally:
        release(held)


def _serve(engine: EngineProcessConfig, server: ServerSettings,
           held: list[socket.socket]) -> int:
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
            log.info(
                "serving %r (max_model_len %d) on http://%s:%d%s%s",
                server.served_model_name,
                client.info.max_model_len,
                server.host,
                server.port,
                " (API key required)" if server.api_key else "",
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
            http = http_server(build_app(client, tokenizer, server), server, front_ends)
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


def resolved(server: ServerSettings, model: str | None) -> ServerSettings:
    """`server` with what its defaults leave to start-up filled in: the served model name
    and the API key (--api-key, else $NANOVLLM_API_KEY, else none)."""
    return dataclasses.replace(
        server,
        served_model_name=server.served_model_name or served_name(model),
        api_key=server.api_key or os.environ.get("NANOVLLM_API_KEY") or None,
    )


def served_name(model: str | None) -> str:
    """The model name clients use: a directory's whole name ("Qwen3-0.6B"), a file's name
    without its extension ("SmolLM2-135M-Instruct.Q4_1" from ".gguf")."""
    if not model:
        return "SmolLM2-135M-Instruct"
    path = Path(model)
    return path.stem if path.is_file() else path.name
