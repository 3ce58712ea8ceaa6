"""Access and admission, on a server of its own: the API key on /v1 routes, 429 with
Retry-After when the waiting queue is full, priorities and preemption (what clients see
once the engine process dies: test_engine_death.py)."""

import asyncio
import time

import httpx
import openai
import pytest

from tests.server.harness import (
    COUNTING,
    GREEDY,
    async_client,
    error_of,
    metric,
    scrape,
    start_server,
    stop_server,
    wait_idle,
)

pytestmark = pytest.mark.slow


API_KEY = "test-secret-key"
STRICT_SEQS, STRICT_WAITING = 2, 2


@pytest.fixture(scope="module")
def strict_server(tmp_path_factory):
    """Its own server (an API key, a tiny waiting queue, no per-request log lines)."""
    flags = (
        f"--api-key {API_KEY} --protect-metrics --no-log-requests --max-model-len 256 "
        f"--max-num-seqs {STRICT_SEQS} --max-num-waiting {STRICT_WAITING} --kv-cache-gib 0.1"
    )
    srv = start_server(tmp_path_factory, "strict", *flags.split())
    yield srv
    stop_server(srv)


def test_api_key_required_on_v1(strict_server, model):
    url = strict_server.url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        error_of(httpx.get(url + "/v1/models", headers=headers, timeout=10), 401, strict_server)
        body = {"model": model, "prompt": "Hi", "max_tokens": 2}
        resp = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=30)
        error_of(resp, 401, strict_server)
    ok = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(url + "/v1/models", headers=ok, timeout=10).status_code == 200
    assert httpx.get(url + "/health", timeout=10).status_code == 200  # open for probes
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    resp = good.completions.create(model=model, prompt=COUNTING, max_tokens=3, **GREEDY)
    assert resp.usage.completion_tokens == 3


def test_api_key_required_on_tokenize_detokenize_and_protected_metrics(strict_server, model):
    """They expose the model (vocabulary, chat template) or its load; /health stays open."""
    url, ok = strict_server.url, {"Authorization": f"Bearer {API_KEY}"}
    calls = [
        ("POST", "/tokenize", {"model": model, "prompt": "Hi"}),
        ("POST", "/detokenize", {"model": model, "tokens": [1, 2]}),
        ("GET", "/metrics", None),  # --protect-metrics
    ]
    for method, path, body in calls:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            resp = httpx.request(method, url + path, json=body, headers=headers, timeout=10)
            assert error_of(resp, 401, strict_server)["code"] == "invalid_api_key"
        resp = httpx.request(method, url + path, json=body, headers=ok, timeout=10)
        assert resp.status_code == 200, resp.text
    assert httpx.get(url + "/health", timeout=10).status_code == 200


def test_overload_gets_429_quickly(strict_server, model):
    total, max_tokens = 12, 40
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {
        "model": model,
        "prompt": "Once upon a time",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
    }

    async def one(h: httpx.AsyncClient) -> tuple[httpx.Response, float]:
        t0 = time.monotonic()
        r = await h.post(strict_server.url + "/v1/completions", json=body, headers=headers)
        return r, time.monotonic() - t0

    async def run():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as h:
            return await asyncio.gather(*(one(h) for _ in range(total)))

    results = asyncio.run(run())
    statuses = sorted(r.status_code for r, _ in results)
    admitted = [(r, t) for r, t in results if r.status_code == 200]
    refused = [(r, t) for r, t in results if r.status_code == 429]
    assert len(admitted) + len(refused) == total, f"statuses {statuses}"
    assert STRICT_WAITING <= len(admitted) <= STRICT_SEQS + STRICT_WAITING, f"statuses {statuses}"
    for r, t in refused:
        error_of(r, 429, strict_server)
        assert float(r.headers.get("retry-after", "nan")) > 0, f"Retry-After: {r.headers}"
        assert t < 3.0, f"a 429 took {t:.1f} s"
    slowest_refusal = max(t for _, t in refused)
    assert slowest_refusal < min(t for _, t in admitted), "refusals should not wait for work"
    print(
        f"overload: {len(admitted)} admitted, {len(refused)} refused in <= {slowest_refusal:.2f} s"
    )
    for r, _ in admitted:
        usage = r.json()["usage"]
        assert usage["completion_tokens"] == max_tokens, r.json()
    good = openai.OpenAI(base_url=strict_server.url + "/v1", api_key=API_KEY, max_retries=0)
    assert good.completions.create(model=model, prompt="Hi", max_tokens=2).choices  # still serves


def test_priority_orders_waiting_and_preempts(strict_server, model):
    """Two long priority-5 requests fill both rows; then a priority-9 request waits and a
    priority-0 one arrives after it: it preempts a priority-5 row and finishes first, and the
    priority-9 one, though earlier, starts only when a row frees."""
    order: list[str] = []
    first_token: dict[str, asyncio.Event] = {}

    async def stream(aclient, name: str, priority: int, max_tokens: int) -> None:
        first_token[name] = asyncio.Event()
        s = await aclient.completions.create(
            model=model,
            prompt=f"Request {name}: once upon a time",
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body={"priority": priority, "ignore_eos": True},
        )
        async for _ in s:
            first_token[name].set()
        order.append(name)

    async def run() -> None:
        async with async_client(strict_server, API_KEY) as aclient:
            # long enough that neither can finish before "high" has come and gone, on a slow CPU
            tasks = [asyncio.create_task(stream(aclient, f"long{i}", 5, 200)) for i in range(2)]
            while len(first_token) < 2:
                await asyncio.sleep(0.01)
            await asyncio.wait_for(
                asyncio.gather(*(first_token[f"long{i}"].wait() for i in range(2))), 120
            )
            tasks.append(asyncio.create_task(stream(aclient, "low", 9, 8)))
            deadline = time.monotonic() + 60
            while metric(scrape(strict_server), "nanovllm:num_requests_waiting") < 1:
                assert time.monotonic() < deadline, '"low" never reached the waiting queue'
                await asyncio.sleep(0.05)  # "low" is queued before "high" arrives
            tasks.append(asyncio.create_task(stream(aclient, "high", 0, 8)))
            await asyncio.wait_for(asyncio.gather(*tasks), 300)

    before = wait_idle(strict_server)
    asyncio.run(run())
    after = wait_idle(strict_server)
    assert order[0] == "high", f"finish order {order}: priority 0 should preempt and finish first"
    assert order.index("low") >= 2, f"finish order {order}: priority 9 should wait for a row"
    preemptions = metric(after, "nanovllm:num_preemptions")
    assert preemptions > metric(before, "nanovllm:num_preemptions"), "no preemption counted"


def test_no_log_requests_leaves_finished_requests_out_of_the_log(strict_server, model):
    # the default server logs a line per finished request (test_engine_death reads them)
    ok = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": model, "prompt": "Hi", "max_tokens": 2}
    resp = httpx.post(strict_server.url + "/v1/completions", json=body, headers=ok, timeout=60)
    assert resp.status_code == 200, resp.text
    log = strict_server.log_path.read_text()
    assert "Uvicorn running" in log or "nanovllm" in log  # the log is the server's
    assert not [line for line in log.splitlines() if "TTFT" in line], log[-2000:]
