"""The server under way: metrics move as requests run, a client that hangs up or times out
has its request aborted and its blocks freed, one log line per request, and 64 concurrent
streams (some dropped midway) each equal to the same request alone, with no error logged."""

import asyncio
import time

import httpx
import pytest

from tests.server.harness import (
    COUNTING,
    GREEDY,
    async_client,
    finished,
    metric,
    read_completion_stream,
    tokenize,
    wait_idle,
)

pytestmark = pytest.mark.slow


# ---- metrics ----------------------------------------------------------------------------------


def test_metrics_move(server, client, model):
    before = wait_idle(server)
    for name in (
        "nanovllm:num_requests_running",
        "nanovllm:num_requests_waiting",
        "nanovllm:kv_cache_usage_perc",
        "nanovllm:prefix_cache_queries",
        "nanovllm:prefix_cache_hits",
        "nanovllm:num_preemptions",
    ):
        metric(before, name)
    assert metric(before, "nanovllm:kv_cache_usage_perc") == 0
    prompt = "Tell me about otters."  # < one block: no prefix-cache hit to muddy the counts
    n_prompt = len(tokenize(server, model, prompt))
    stream = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=5,
        stream=True,
        extra_body={"ignore_eos": True},
        **GREEDY,
    )
    _, reasons, _, _ = read_completion_stream(stream)
    assert reasons == {0: "length"}
    after = wait_idle(server)

    def delta(name: str) -> float:
        return metric(after, name) - metric(before, name)

    assert delta("nanovllm:prompt_tokens") == n_prompt
    assert delta("nanovllm:generation_tokens") == 5
    assert finished(after, "length") - finished(before, "length") == 1
    for h in (
        "nanovllm:time_to_first_token_seconds",
        "nanovllm:time_per_output_token_seconds",
        "nanovllm:e2e_request_latency_seconds",
        "nanovllm:request_queue_time_seconds",
    ):
        assert h + "_bucket" in after, f"/metrics has no histogram {h}: {sorted(after)}"
        assert delta(h + "_count") >= 1, f"{h} did not observe the streamed request"


# ---- cancellation, timeouts -------------------------------------------------------------------


def test_non_streamed_request_aborted_on_disconnect(server, model):
    before = wait_idle(server)
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}
    t0 = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):  # the client gives up after 1 s and hangs up
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(1.0))
    # 400 CPU tokens take ~15 s; an aborted request frees its blocks within a step
    after = wait_idle(server, timeout=6.0)
    assert time.monotonic() - t0 < 10
    assert finished(after, "abort") - finished(before, "abort") == 1


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_timeout_finishes_request(server, client, model, stream):
    before = wait_idle(server)
    kw = dict(
        model=model,
        prompt="Once upon a time",
        max_tokens=400,
        extra_body={"ignore_eos": True, "timeout": 0.5},
    )
    t0 = time.monotonic()
    if stream:
        texts, reasons, _, _ = read_completion_stream(client.completions.create(stream=True, **kw))
        reason, text = reasons[0], texts[0]
    else:
        resp = client.completions.create(**kw)
        reason, text = resp.choices[0].finish_reason, resp.choices[0].text
        assert 0 < resp.usage.completion_tokens < 400, resp.usage
    elapsed = time.monotonic() - t0
    assert reason == "timeout", f"finish_reason {reason!r} after {elapsed:.1f} s"
    assert elapsed < 6.0, f"a 0.5 s timeout took {elapsed:.1f} s"
    assert text, "the text generated before the timeout is returned"
    after = wait_idle(server, timeout=5.0)
    assert finished(after, "timeout") - finished(before, "timeout") == 1


def test_logs_one_line_per_finished_request(server, client, model):
    resp = client.completions.create(model=model, prompt=COUNTING, max_tokens=3, **GREEDY)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        lines = [ln for ln in server.log_path.read_text().splitlines() if resp.id in ln]
        if lines:
            break
        time.sleep(0.1)
    assert len(lines) == 1, f"log lines naming {resp.id}: {lines}\n{server.log_tail(10)}"
    assert "length" in lines[0], lines[0]


# ---- concurrency ------------------------------------------------------------------------------

SUBJECTS = ["cats", "the moon", "rivers", "bread", "winter", "robots", "music", "trees"]
TASKS = [
    "Describe {} in one sentence.",
    "Write a short poem about {}.",
    "Give one fact about {}.",
    "Why do people like {}?",
    "What color are {}?",
    "Tell a joke about {}.",
    "List two things about {}.",
    "Explain {} to a child.",
]
NUM_CLIENTS = 64


def _concurrent_requests() -> list[dict]:
    """64 requests: even ones chat, odd ones completions; every fourth hangs up early."""
    reqs = []
    for i in range(NUM_CLIENTS):
        question = TASKS[i % 8].format(SUBJECTS[i // 8])
        drop = i % 4 == 3
        req = dict(
            kind="chat" if i % 2 == 0 else "completion",
            drop=drop,
            max_tokens=300 if drop else 4 + (i * 7) % 21,  # 4..24; droppers would run long
        )
        if req["kind"] == "chat":
            req["messages"] = [{"role": "user", "content": question}]
        else:
            req["prompt"] = f"Question: {question}\nAnswer:"
        reqs.append(req)
    return reqs


async def _one(aclient, model: str, req: dict, stream: bool) -> tuple[str, str | None]:
    extra = {"ignore_eos": True} if req["drop"] else None
    kw = dict(model=model, max_tokens=req["max_tokens"], temperature=0.0, extra_body=extra)
    if req["kind"] == "chat":
        create, kw["messages"] = aclient.chat.completions.create, req["messages"]
    else:
        create, kw["prompt"] = aclient.completions.create, req["prompt"]

    def piece(choice) -> str:
        return (choice.delta.content or "") if req["kind"] == "chat" else (choice.text or "")

    if not stream:
        resp = await create(**kw)
        c = resp.choices[0]
        return (c.message.content if req["kind"] == "chat" else c.text), c.finish_reason
    text, reason, chunks = "", None, 0
    s = await create(stream=True, **kw)
    async for chunk in s:
        chunks += 1
        for c in chunk.choices:
            text += piece(c)
            reason = c.finish_reason or reason
        if req["drop"] and (text or chunks >= 3):
            await s.close()  # hang up mid-stream
            return text, "dropped"
    return text, reason


def test_concurrent_streams_with_disconnects(server, model):
    reqs = _concurrent_requests()
    keep = [i for i, r in enumerate(reqs) if not r["drop"]]
    since = server.log_size()

    async def run():
        async with async_client(server) as aclient:
            refs = await asyncio.gather(*(_one(aclient, model, reqs[i], False) for i in keep))
            before = wait_idle(server)
            t0 = time.monotonic()
            outs = await asyncio.wait_for(
                asyncio.gather(*(_one(aclient, model, r, True) for r in reqs)), timeout=300
            )
            return dict(zip(keep, refs)), outs, before, time.monotonic() - t0

    refs, outs, before, elapsed = asyncio.run(run())
    wrong = [
        f"#{i} ({reqs[i]['kind']}, max_tokens {reqs[i]['max_tokens']}): streamed {outs[i]!r}, "
        f"alone {refs[i]!r}"
        for i in keep
        if outs[i] != refs[i]
    ]
    assert not wrong, f"{len(wrong)} of {len(keep)} streams differ:\n" + "\n".join(wrong)
    assert all(outs[i][1] == "dropped" for i, r in enumerate(reqs) if r["drop"])
    after = wait_idle(server, timeout=15.0)  # every KV block back once the droppers abort
    dropped = NUM_CLIENTS - len(keep)
    assert finished(after, "abort") - finished(before, "abort") == dropped
    done = sum(finished(after, r) - finished(before, r) for r in ("stop", "length"))
    assert done == len(keep)
    problems = server.log_problems(since)  # a client that hangs up is no error
    assert not problems, "\n".join(problems[:20])
    print(f"{NUM_CLIENTS} concurrent streams in {elapsed:.1f} s")
