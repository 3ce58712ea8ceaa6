"""/metrics values, not only names: exact counter deltas for known requests (prefix-cache
hits of a repeated prompt, prompt and generation tokens, engine steps), KV cache usage
while a stream runs, and latency histograms bounded by what the client measured."""

import asyncio
import random
import time

import pytest

from nanovllm.engine.resolve import BLOCK_SIZE  # the session server's (CPU): no --block-size
from tests.server.harness import async_client, metric, post, scrape, wait_idle

pytestmark = pytest.mark.slow

TTFT = "nanovllm:time_to_first_token_seconds"
E2E = "nanovllm:e2e_request_latency_seconds"


def _prompt(seed: int, n: int) -> list[int]:
    """Random token ids no other test sends, so nothing of them is cached before."""
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


def _delta(after: dict, before: dict, name: str) -> float:
    return metric(after, name) - metric(before, name)


def test_prefix_cache_hits_grow_by_exactly_the_cached_tokens(server, model):
    """A prompt sent twice: the first finds nothing, the second every full block but the one
    holding the last token (computed again for logits): nanovllm:prefix_cache_hits grows by
    exactly that, which usage reports as cached_tokens; queries and prompt tokens grow by the
    prompt each time, generation tokens by what was generated."""
    prompt = _prompt(seed=1, n=3 * BLOCK_SIZE + 5)
    body = dict(model=model, prompt=prompt, max_tokens=3, temperature=0, ignore_eos=True)
    cached = (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
    snapshots = [wait_idle(server)]
    for expect_cached in (0, cached):
        usage = post(server, "/v1/completions", body)["usage"]
        snapshots.append(wait_idle(server))
        before, after = snapshots[-2:]
        assert usage["prompt_tokens_details"]["cached_tokens"] == expect_cached
        assert _delta(after, before, "nanovllm:prefix_cache_hits") == expect_cached
        assert _delta(after, before, "nanovllm:prefix_cache_queries") == len(prompt)
        assert _delta(after, before, "nanovllm:prompt_tokens") == len(prompt)
        assert _delta(after, before, "nanovllm:generation_tokens") == 3
        # one step runs the prompt (its first chunk is the whole of it) and makes the first
        # token, two decode steps the others
        assert _delta(after, before, "nanovllm:engine_steps") == 3
        assert _delta(after, before, "nanovllm:engine_prefill_steps") == 1


def test_engine_loop_seconds_account_for_the_engine_process_time(server, model):
    """nanovllm:engine_loop_seconds{phase}: between two scrapes the phases add up to the
    time between them (the loop is always in one); idle, only idle and receive grow; a
    request's steps show up as schedule, launch, wait, postprocess, outputs and send."""
    phases = ("idle", "receive", "schedule", "launch", "wait", "postprocess", "outputs", "send")

    def loop(samples):
        return {p: metric(samples, "nanovllm:engine_loop_seconds", phase=p) for p in phases}

    wait_idle(server)
    start = time.perf_counter()
    before = scrape(server)
    inner_start = time.perf_counter()
    time.sleep(0.5)  # shorter than the idle loop's nap (1 s): the reply counts its current one
    inner_end = time.perf_counter()
    after = scrape(server)
    end = time.perf_counter()
    grown = {p: b - a for (p, a), b in zip(loop(before).items(), loop(after).values())}
    assert inner_end - inner_start <= sum(grown.values()) <= end - start, grown
    assert grown["idle"] >= 0.9 * (inner_end - inner_start), grown
    in_steps = ("schedule", "launch", "wait", "postprocess", "outputs")
    assert all(grown[p] == 0 for p in in_steps), grown

    before = wait_idle(server)
    post(server, "/v1/completions", dict(model=model, prompt=_prompt(seed=4, n=40),
                                         max_tokens=8, temperature=0, ignore_eos=True))
    after = wait_idle(server)
    grown = {p: b - a for (p, a), b in zip(loop(before).items(), loop(after).values())}
    busy = ("schedule", "launch", "postprocess", "outputs", "send")
    assert all(grown[p] > 0 for p in busy), grown
    assert _delta(after, before, "nanovllm:engine_steps") == 8


def test_the_engine_process_freezes_its_start_up_and_counts_gc_pauses(server):
    """The engine process left its start-up's objects out of the garbage collector's walks
    (freeze_heap), and /metrics counts its collector's pauses per generation, the full
    collection that freeze_heap runs first among them."""
    samples = scrape(server)
    assert metric(samples, "nanovllm:engine_gc_frozen_objects") > 10_000
    pauses = {g: metric(samples, "nanovllm:engine_gc_seconds", generation=g) for g in "012"}
    assert all(p >= 0 for p in pauses.values()) and pauses["2"] > 0, pauses


def test_kv_cache_usage_while_a_stream_runs(server, client, model):
    """Mid-stream the KV cache holds at least the prompt's blocks, and kv_cache_usage_perc is
    the used fraction of the blocks /metrics counts; idle, it is 0 again."""
    idle = wait_idle(server)
    assert metric(idle, "nanovllm:kv_cache_usage_perc") == 0
    prompt = _prompt(seed=2, n=4 * BLOCK_SIZE)
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    mid = None
    for chunk in stream:
        if mid is None and chunk.choices and chunk.choices[0].text:
            mid = scrape(server)  # the stream has its first token and 11 to go
    total = metric(mid, "nanovllm:num_kv_blocks")
    used = total - metric(mid, "nanovllm:num_free_kv_blocks")
    assert metric(mid, "nanovllm:num_requests_running") == 1
    assert used >= len(prompt) // BLOCK_SIZE, "the running prompt's blocks are not in use"
    assert metric(mid, "nanovllm:kv_cache_usage_perc") == pytest.approx(used / total)
    assert metric(wait_idle(server), "nanovllm:kv_cache_usage_perc") == 0


def test_ttft_and_e2e_histograms_bound_each_other(server, model):
    """Three streams with a long prompt and two tokens each (prefill dominates): each is one
    observation of TTFT and of end-to-end latency; the TTFT sum is at most the end-to-end
    sum, and each sum at most what the client measured around the same requests."""
    before = wait_idle(server)
    client_ttft = client_e2e = 0.0

    async def one(aclient, seed: int) -> tuple[float, float]:
        start = time.monotonic()
        first = None
        async for chunk in await aclient.completions.create(
                model=model, prompt=_prompt(seed, 300), max_tokens=2, temperature=0,
                stream=True, extra_body={"ignore_eos": True}):
            if first is None and chunk.choices and chunk.choices[0].text:
                first = time.monotonic() - start
        return first, time.monotonic() - start

    async def run() -> list[tuple[float, float]]:
        async with async_client(server) as aclient:
            return [await one(aclient, seed) for seed in (3, 4, 5)]

    for ttft, e2e in asyncio.run(run()):
        client_ttft, client_e2e = client_ttft + ttft, client_e2e + e2e
    after = wait_idle(server)
    assert _delta(after, before, TTFT + "_count") == _delta(after, before, E2E + "_count") == 3
    ttft, e2e = _delta(after, before, TTFT + "_sum"), _delta(after, before, E2E + "_sum")
    assert 0 < ttft <= e2e, f"TTFT sum {ttft:.3f} s, end-to-end sum {e2e:.3f} s"
    assert ttft <= client_ttft and e2e <= client_e2e, (
        f"server TTFT {ttft:.3f} / e2e {e2e:.3f} s, client {client_ttft:.3f} / {client_e2e:.3f} s")
