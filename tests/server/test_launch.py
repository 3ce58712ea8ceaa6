"""`nanovllm serve` start-up: a busy port fails at once, before any model loads, the port
stays the server's while the engine starts, and the served model name comes from the model's
path."""

import os
import socket
import subprocess
import sys
import time

from nanovllm.entrypoints.openai.launch import served_name
from nanovllm.entrypoints.openai.sockets import release, reserve_address
from tests.server.harness import REPO


def test_busy_port_exits_2_before_loading_the_model(tiny_llama):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = ["serve", "--port", str(port), "--model", str(tiny_llama), "--device", "cpu"]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p
        ))  # fmt: skip
        t0 = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "nanovllm", *args],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        elapsed = time.monotonic() - t0
    assert done.returncode == 2, f"exit status {done.returncode}:\n{done.stderr}"
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and f"127.0.0.1:{port}" in errors[0], done.stderr
    assert "in use" in errors[0] and "--port" in errors[0], errors[0]
    assert "Traceback" not in done.stderr, done.stderr
    assert "starting the engine process" not in done.stderr, "the model was loaded first"
    assert elapsed < 60, f"took {elapsed:.0f} s to refuse a busy port"


def test_the_port_is_held_while_the_engine_starts():
    # a tensor-parallel rendezvous once got the server's own port from the OS (it asks for
    # any free one) while the engine started: held, no socket can bind it, not even one that
    # sets SO_REUSEADDR; released, uvicorn's way of binding takes it
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    held = reserve_address("127.0.0.1", port)
    try:
        with socket.socket() as other:
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                other.bind(("127.0.0.1", port))
                taken = True
            except OSError:
                taken = False
        assert not taken, "another socket bound the held port"
    finally:
        release(held)
    assert held == []
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen()


def test_served_name_keeps_dots_in_directory_names(tmp_path):
    (tmp_path / "Qwen3-0.6B").mkdir()
    (tmp_path / "model.Q4_1.gguf").write_bytes(b"")
    assert served_name(str(tmp_path / "Qwen3-0.6B")) == "Qwen3-0.6B"
    assert served_name(str(tmp_path / "model.Q4_1.gguf")) == "model.Q4_1"
    assert served_name(None) == "SmolLM2-135M-Instruct"
