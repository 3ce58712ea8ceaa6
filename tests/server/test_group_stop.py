"""A supervisor's stop reaches every process of the server at once (systemd's default
KillMode sends SIGTERM to the whole control group; a terminal's Ctrl-C reaches the whole
process group): the front end drains what is in flight before its engine goes, so a
request running at that moment still ends well, and the server exits cleanly (uvicorn
ends by raising the SIGTERM again, which systemd counts as a clean stop)."""

import json
import os
import signal
import threading

import httpx
import pytest

from tests.server.harness import ServerProcess
from tests.support import build_tiny_model

MAX_TOKENS = 200  # 1-3 s on the tiny model (TP 2 on a loaded 2-core machine): within
# uvicorn's 5 s to drain


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_sigterm_to_every_process_drains_the_stream_in_flight(tmp_path, tp):
    model_dir = build_tiny_model(tmp_path / "model", "llama")
    srv = ServerProcess(tmp_path / "server.log", "--model", str(model_dir),
                        "--tensor-parallel-size", str(tp))
    try:
        srv.wait_ready()
        model = httpx.get(srv.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        events: list[str] = []
        first = threading.Event()

        def stream() -> None:
            body = {"model": model, "prompt": [5, 6, 7, 8], "max_tokens": MAX_TOKENS,
                    "ignore_eos": True, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}}
            with httpx.stream("POST", srv.url + "/v1/completions", json=body,
                              timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(60), "the stream never started"
        everyone = [srv.proc.pid, *srv.descendants()]
        assert len(everyone) >= 1 + tp, everyone  # the front end, the engine, its ranks
        srv.known_children |= set(everyone[1:])
        streamed_before = len(events)
        for pid in everyone:  # as systemd stops a unit: all at once
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        reader.join(60)
        assert not reader.is_alive(), "the stream hung"
        # the stop came with most of the stream still to come (a chunk carries a token or two)
        assert streamed_before < MAX_TOKENS // 2, streamed_before
        assert events[-1] == "[DONE]", events[-3:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert not any("error" in c for c in chunks), chunks[-2:]
        assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS, chunks[-1]
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        assert srv.proc.wait(30) in (0, -signal.SIGTERM), srv.log_tail()
        log = srv.log_path.read_text()
        assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
    finally:
        problems = srv.stop()
    assert not problems, problems
