"""Two `nanovllm serve` workers behind sglang-router (its cache-aware policy), the README's
recipe for serving across hosts: requests that share a prefix land on one worker, and a
worker that dies leaves the rotation while the other serves every request."""

import subprocess
import sys
import time

import httpx
import pytest

from tests.server.harness import _free_port, finished, scrape, start_server, stop_server

pytest.importorskip("sglang_router", reason="the test extra installs sglang-router")

POLICY = "cache_aware"
FLAGS = "--max-model-len 1024 --kv-cache-gib 0.25 --weight-format dense".split()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    workers = [start_server(tmp_path_factory, f"worker{i}", *FLAGS) for i in range(2)]
    port = _free_port()
    log = open(tmp_path_factory.mktemp("router") / "router.log", "wb")
    router = subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
         "--port", str(port), "--policy", POLICY,
         "--worker-urls", *(w.url for w in workers),
         "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
         "--log-level", "warn"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert router.poll() is None, "the router exited"
            try:
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the router never answered"
            time.sleep(0.25)
        yield url, workers
    finally:
        router.terminate()
        router.wait(10)
        log.close()
        for w in workers:
            if w.proc.poll() is None:
                stop_server(w)
            else:
                w.stop(timeout=5)  # killed by the test: reap what is left, close its log


def served(workers) -> list[float]:
    """Requests each live worker has finished (0 for a dead one)."""
    return [finished(scrape(w), "length") if w.proc.poll() is None else 0.0 for w in workers]


def chat(url: str, model: str, text: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 2,
            "temperature": 0}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


def test_a_shared_prefix_lands_on_one_worker_and_a_dead_worker_leaves(cluster):
    url, workers = cluster
    model = httpx.get(workers[0].url + "/v1/models", timeout=5).json()["data"][0]["id"]
    # settle whichever worker the router picks first, then every request sharing the
    # document must follow it
    document = " ".join(f"Clause {i}: the tenant keeps the garden tidy." for i in range(40))
    before = served(workers)
    for i in range(6):
        resp = chat(url, model, f"{document}\nQuestion {i}: who keeps the garden?")
        assert resp.status_code == 200, resp.text
    moved = [b - a for a, b in zip(before, served(workers))]
    assert sorted(moved) == [0, 6], f"requests per worker: {moved}"

    home = moved.index(6)
    other = 1 - home
    workers[home].proc.kill()  # dies without a goodbye; the router must notice
    workers[home].proc.wait()
    time.sleep(3)  # health checks every second, one failure takes it out
    before = served(workers)
    for i in range(4):
        resp = chat(url, model, f"{document}\nQuestion {10 + i}: who keeps the garden?")
        assert resp.status_code == 200, resp.text
    assert served(workers)[other] - before[other] == 4

