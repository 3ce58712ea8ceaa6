"""`nanovllm serve --data-parallel-size 2`: two engine processes behind one front end.
Requests sharing a prompt prefix go to one replica, other prompts spread by load, /metrics
reports each replica, and a replica that dies is taken out and named by /health while the
other serves."""

import os
import signal
import time

import httpx
import pytest

from tests.server.harness import metric, scrape, start_server

FLAGS = "--data-parallel-size 2 --max-model-len 1024 --kv-cache-gib 0.25 --weight-format dense"


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory):
    srv = start_server(tmp_path_factory, "dp", *FLAGS.split())
    yield srv
    srv.stop(timeout=30)  # a replica was killed: its error lines are expected


def served(samples, replica: str) -> float:
    return metric(samples, "nanovllm:request_success", replica=replica)


def complete(srv, model: str, prompt: str) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    return httpx.post(srv.url + "/v1/completions", json=body, timeout=120)


def engine_pids(srv) -> list[int]:
    pids = []
    for pid in srv.descendants():
        try:
            if b"spawn_main" in open(f"/proc/{pid}/cmdline", "rb").read():
                pids.append(pid)
        except OSError:
            pass
    return pids


def test_replicas_share_the_load_keep_prefixes_together_and_survive_a_death(dp_server):
    srv = dp_server
    model = httpx.get(srv.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    assert len(engine_pids(srv)) == 2
    document = " ".join(f"Clause {i}: the tenant keeps the garden tidy." for i in range(30))
    before = scrape(srv)
    for i in range(5):
        assert complete(srv, model, f"{document} Question {i}:").status_code == 200
    after = scrape(srv)
    moved = sorted(served(after, r) - served(before, r) for r in ("0", "1"))
    assert moved == [0, 5], f"a shared prefix split across replicas: {moved}"
    # one at a time, prompts with nothing in common take turns
    for i in range(4):
        assert complete(srv, model, f"Unrelated note {i}: " * (i + 2)).status_code == 200
    turns = scrape(srv)
    assert [served(turns, r) - served(after, r) for r in ("0", "1")] == [2, 2]
    after = turns

    # requests in flight at once, with nothing in common, use both replicas
    import concurrent.futures as cf
    with cf.ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda i: complete(srv, model, f"Story {i}: " * (i + 1))
                              .status_code, range(16)))
    assert codes == [200] * 16
    spread = scrape(srv)
    assert all(served(spread, r) > served(after, r) for r in ("0", "1"))

    victim = engine_pids(srv)[0]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while "is down" not in (health := httpx.get(srv.url + "/health", timeout=5)).text:
        assert time.monotonic() < deadline, "/health never named the dead replica"
        time.sleep(0.2)
    assert health.status_code == 200
    for i in range(4):
        resp = complete(srv, model, f"{document} Question {10 + i}:")
        assert resp.status_code == 200, resp.text
    samples = scrape(srv)
    assert len({ls for ls in samples["nanovllm:num_requests_running"]}) == 1  # one replica left


def test_each_replica_publishes_kv_events_on_its_own_port():
    from nanovllm.entrypoints.openai.replicas import offset_port

    assert offset_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_port("tcp://*:5557", 1) == "tcp://*:5558"
    assert offset_port("tcp://127.0.0.1:6000", 3) == "tcp://127.0.0.1:6003"
    assert offset_port("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
