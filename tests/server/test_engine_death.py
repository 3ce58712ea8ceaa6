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

# ~500 steps of the tiny model: the engine is killed while both requests still run
LONG = {"prompt": [5, 6, 7, 8], "max_tokens": 500, "ignore_eos": True, "temperature": 0.0}


def test_engine_death_fails_what_is_in_flight_and_exits_non_zero(tiny_llama, tmp_path):
    srv = ServerProcess(tmp_path / "server.log", "--model", str(tiny_llama),
                        "--max-model-len", "512", "--max-num-seqs", "4")
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
        waiter.start()
        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(60), "the stream never started"
        # both requests in the engine before it dies (the plain one may still be on its way:
        # a request the engine never accepted gets its 503 but no log line)
        deadline = time.monotonic() + 30
        while metric(scrape(srv), "nanovllm:num_requests_running") < 2:
            assert time.monotonic() < deadline, "the two requests never ran together"
            time.sleep(0.05)
        srv.known_children |= set(srv.descendants())
        killed_at = time.monotonic()
        os.kill(srv.engine_pid(), signal.SIGKILL)
        reader.join(30)
        waiter.join(30)
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
