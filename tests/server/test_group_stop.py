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

MAX_TOKENS = 200  # 1-6 s on the tiny model (TP 2 on a loaded 2-core machine)
DRAIN_S = 60  # --drain-timeout: the stream has all the time it needs (5 s by default, which
# a loaded CI machine's TP 2 run once needed more than: 194 of 200 tokens)


class Stream:
    """A streamed completion of `max_tokens` read on a thread of its own: `events` (the SSE
    data lines), `first` (set at the first one)."""

    def __init__(self, srv: ServerProcess, max_tokens: int) -> None:
        model = httpx.get(srv.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        self.body = {"model": model, "prompt": [5, 6, 7, 8], "max_tokens": max_tokens,
                     "ignore_eos": True, "temperature": 0.0, "stream": True,
                     "stream_options": {"include_usage": True}}
        self.url, self.events, self.first = srv.url, [], threading.Event()
        self.reader = threading.Thread(target=self.read)
        self.reader.start()
        assert self.first.wait(60), "the stream never started"

    def read(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=self.body,
                              timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        self.first.set()
        except httpx.RemoteProtocolError:  # the body cut short: events says how far it got
            pass


def stop_everyone(srv: ServerProcess, tp: int) -> None:
    """SIGTERM to the server's every process at once, as systemd stops a unit."""
    everyone = [srv.proc.pid, *srv.descendants()]
    assert len(everyone) >= 1 + tp, everyone  # the front end, the engine, its ranks
    srv.known_children |= set(everyone[1:])
    for pid in everyone:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_sigterm_to_every_process_drains_the_stream_in_flight(tmp_path, tp):
    model_dir = build_tiny_model(tmp_path / "model", "llama")
    srv = ServerProcess(tmp_path / "server.log", "--model", str(model_dir),
                        "--tensor-parallel-size", str(tp), "--drain-timeout", str(DRAIN_S))
    try:
        srv.wait_ready()
        stream = Stream(srv, MAX_TOKENS)
        events = stream.events
        streamed_before = len(events)
        stop_everyone(srv, tp)
        stream.reader.join(DRAIN_S + 10)
        assert not stream.reader.is_alive(), "the stream hung"
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


def test_a_stop_cancels_what_outlasts_the_drain_timeout(tmp_path):
    # --drain-timeout 0: the stop cancels the stream at once; it ends cut short (no [DONE]),
    # the request is logged as aborted and every process exits
    model_dir = build_tiny_model(tmp_path / "model", "llama")
    srv = ServerProcess(tmp_path / "server.log", "--model", str(model_dir),
                        "--drain-timeout", "0")
    try:
        srv.wait_ready()
        stream = Stream(srv, 500)
        stop_everyone(srv, 1)
        stream.reader.join(30)
        assert not stream.reader.is_alive(), "the stream hung"
        # cut short: no usage chunk, no [DONE] (500 tokens take a second or more; the
        # stop cancels ~0.1 s after the first)
        assert stream.events and stream.events[-1] != "[DONE]", stream.events[-2:]
        assert srv.proc.wait(30) in (0, -signal.SIGTERM), srv.log_tail()
        log = srv.log_path.read_text()
        assert ", abort" in log and "Traceback" not in log, log[-3000:]
    finally:
        problems = srv.stop()
    assert not problems, problems


def test_a_negative_drain_timeout_is_refused(tmp_path):
    from nanovllm.core.errors import ConfigError
    from nanovllm.engine.messages import EngineProcessConfig
    from nanovllm.entrypoints.openai.launch import ServerSettings, run_server

    model_dir = build_tiny_model(tmp_path / "model", "llama")
    with pytest.raises(ConfigError, match=r"--drain-timeout -1.0 is invalid; use 0 or more"):
        run_server(EngineProcessConfig(str(model_dir)), ServerSettings(port=0,
                                                                       drain_timeout=-1.0))
