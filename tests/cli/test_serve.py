"""`nanovllm serve` stops cleanly on Ctrl-C, while it loads and while it serves."""

import os
import signal
import socket

from tests.cli.process import finish, read_until, start_cli


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
