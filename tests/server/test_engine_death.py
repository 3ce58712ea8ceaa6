"""When the engine process dies, the server is no zombie: requests in flight end with a clear
error (a 503 body, or an error event in the stream), their log lines say `error`, and
`nanovllm serve` exits with status 1 so a supervisor starts a fresh one."""

import json
import os
import signal
import threading
import time

import httpx

from tests.server.harness import ServerProcess, metric, scrape
from tests.support import build_tiny_model

# ~16,000 steps of the tiny model, tens of seconds even unloaded: the engine is killed while
# both requests run, however late the client threads see their first tokens
LONG = {"prompt": [5, 6, 7, 8], "max_tokens": 16000, "ignore_eos": True, "temperature": 0.0}


def test_engine_death_fails_what_is_in_flight_and_exits_non_zero(tmp_path):
    model_dir = build_tiny_model(tmp_path / "model", "llama", max_position_embeddings=16384)
    srv = ServerProcess(tmp_path / "server.log", "--model", str(model_dir),
                        "--max-model-len", "16384", "--max-num-seqs", "4")
    try:
        srv.wait_ready()
        model = httpx.get(srv.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        streamed: list[str] = []
        started = threading.Event()

        def stream() -> None:
            body = {**LONG, "model": model, "stream": True}
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        streamed.append(line[6:])
                        started.set()

        plain: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: plain.append(httpx.post(
            srv.url + "/v1/completions", json={**LONG, "model": model}, timeout=60)))
        # Both requests wait in the engine's pipe while it is stopped, so it admits them in
        # one step and they run in step: when the stream has its first token the plain
        # request runs too. Sent to a running engine, on a loaded 2-core machine, the plain
        # one could finish its 500 steps before the stream started.
        engine = srv.engine_pid()
        os.kill(engine, signal.SIGSTOP)
        try:
            waiter.start()
            reader = threading.Thread(target=stream)
            reader.start()
            time.sleep(2.0)  # two local POSTs reach the pipe
        finally:
            os.kill(engine, signal.SIGCONT)
        assert started.wait(60), "the stream never started"
        deadline = time.monotonic() + 30
        while metric(scrape(srv), "nanovllm:num_requests_running") < 2:
            assert time.monotonic() < deadline, "the two requests never ran together"
            time.sleep(0.05)
        srv.known_children |= set(srv.descendants())
        killed_at = time.monotonic()
        os.kill(engine, signal.SIGKILL)
        reader.join(60)
        waiter.join(60)
        assert not reader.is_alive() and not waiter.is_alive(), "a request hung on a dead engine"

        # the stream: tokens, then an error event with OpenAI's body, then [DONE]
        assert streamed[-1] == "[DONE]", streamed[-3:]
        error = json.loads(streamed[-2])["error"]
        assert error["code"] == "engine_dead" and "engine" in error["message"], error
        # the non-streamed request: 503 with OpenAI's body
        assert plain[0].status_code == 503, plain[0].text
        assert plain[0].json()["error"]["code"] == "engine_dead"

        assert srv.proc.wait(30) == 1, "the server did not exit with status 1"
        assert time.monotonic() - killed_at < 15
        log = srv.log_path.read_text()
        assert "Traceback" not in log, log[-3000:]
        ended = [line for line in log.splitlines() if "completion" in line and "TTFT" in line]
        assert len(ended) >= 2 and all(line.endswith("error") for line in ended[-2:]), ended
        assert "exiting with status 1" in log
    finally:
        problems = srv.stop(timeout=10)
        assert not problems, problems
