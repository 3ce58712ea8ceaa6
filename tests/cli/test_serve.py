"""`nanovllm serve` stops cleanly on Ctrl-C, while it loads and while it serves."""

import os
import signal
import socket
import sys

import pytest

from tests.cli.process import finish, press_ctrl_c_in_a_finalizer, read_until, start_cli


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ctrl_c_stops_the_server(tiny_llama):
    serve = ["serve", "--model", str(tiny_llama), "--device", "cpu", "--port", str(_free_port())]
    # while the engine process starts: the front end, which stops the engine process itself
    proc = start_cli(*serve)
    read_until(proc.stderr, b"starting the engine process")
    proc.send_signal(signal.SIGINT)
    status, _, err = finish(proc)
    assert status == 130 and "Traceback" not in err, err
    # while serving: the whole process group, as a terminal's Ctrl-C
    proc = start_cli(*serve, group=True)
    read_until(proc.stderr, b"Application startup complete")
    os.killpg(proc.pid, signal.SIGINT)
    status, _, err = finish(proc)
    assert status == 0 and "Traceback" not in err, err
    assert "Finished server process" in err


def test_a_ctrl_c_python_drops_while_the_engine_starts_still_stops(tiny_llama, monkeypatch):
    """A Ctrl-C whose KeyboardInterrupt lands in a finalizer while the engine process starts
    (process start-up runs several) is dropped by Python, and the server would start and
    serve; it raises it again once started, before serving, and stops the engine process
    it started."""
    from nanovllm.core.config import EngineConfig
    from nanovllm.engine.messages import EngineProcessConfig
    from nanovllm.entrypoints.openai import launch
    from nanovllm.entrypoints.openai.replicas import ReplicaSet

    started = []
    real_start = ReplicaSet.start.__func__

    def start(cls, *args, **kwargs):
        started.append(real_start(cls, *args, **kwargs))
        press_ctrl_c_in_a_finalizer()  # the engine process running
        return started[-1]

    class Serving:  # where uvicorn would serve: never reached once Ctrl-C was pressed
        should_exit = False

        def run(self, sockets=None):
            raise AssertionError("the server went on to serve after a Ctrl-C")

    monkeypatch.setattr(ReplicaSet, "start", classmethod(start))
    monkeypatch.setattr(launch, "http_server", lambda *args: Serving())
    monkeypatch.setattr(launch, "freeze_heap", lambda: None)  # pytest's heap: left as it is
    monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)
    engine = EngineProcessConfig(str(tiny_llama), EngineConfig(device="cpu"))
    server = launch.ServerSettings("127.0.0.1", _free_port())
    with pytest.raises(KeyboardInterrupt):
        launch.run_server(engine, server)
    assert started and not started[0].clients[0].proc.is_alive()


def test_api_server_count_defaults_to_two_on_a_gpu(monkeypatch):
    """--api-server-count: 2 front ends when the engines run on a GPU, 1 on a CPU; with
    --device auto, a GPU is what torch would find (the driver's device files, unless
    CUDA_VISIBLE_DEVICES hides them), looked for without loading torch."""
    from nanovllm.entrypoints.cli import serve

    devices = []
    monkeypatch.setattr(serve.glob, "glob", lambda pattern: list(devices))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert serve.default_api_server_count("cpu") == 1
    assert serve.default_api_server_count("cuda") == 2
    assert serve.default_api_server_count("auto") == 1
    devices.append("/dev/nvidia0")
    assert serve.default_api_server_count("auto") == 2
    assert serve.default_api_server_count("cpu") == 1
    for hidden in ("", "-1"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert serve.default_api_server_count("auto") == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert serve.default_api_server_count("auto") == 2
