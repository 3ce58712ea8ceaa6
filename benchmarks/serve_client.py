"""The serving benchmark's client (benchmarks/serve.py): streamed requests over HTTP
(aiohttp), sent as a Poisson process from one or more processes, and each rate's latencies
and throughput (summarize).

--client-procs' spawned processes run drive_shard from this module, not from serve.py's
__main__.
"""

import asyncio
import json
import math
import multiprocessing
import os
import random
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import aiohttp


@dataclass
class Request:
    body: dict  # JSON body without model/stream fields
    path: str  # /v1/completions or /v1/chat/completions
    prompt: list[int] | list[dict]  # what the offline run gets
    output_len: int


@dataclass
class Result:
    ok: bool
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    chunks: int = 0


JSON_HEADERS = {"content-type": "application/json"}
CLIENT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)  # what a failed request raises
REQUEST_TIMEOUT_S = 1800
SEED = 0  # the prompts' and the arrivals' draws


def encode_body(model: str, req: Request) -> bytes:
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True}, **req.body}
    return json.dumps(body).encode()


async def send(session: aiohttp.ClientSession, model: str, req: Request,
               body: bytes | None = None) -> Result:
    """One streamed request; `body`, its JSON encoded ahead of time (encode_body), keeps a
    burst's requests from waiting on each other's encoding."""
    if body is None:
        body = encode_body(model, req)
    stamps: list[float] = []
    usage_tokens = None
    t0 = time.perf_counter()
    try:
        async with session.post(req.path, data=body, headers=JSON_HEADERS) as resp:
            if resp.status != 200:
                text = (await resp.read()).decode(errors="replace")
                return Result(False, f"HTTP {resp.status}: {text[:200]}")
            buf = b""
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                buf += data.replace(b"\r\n", b"\n") if b"\r" in data else data
                *events, buf = buf.split(b"\n\n")
                for event in events:
                    if not event.startswith(b"data: ") or event == b"data: [DONE]":
                        continue
                    chunk = json.loads(event[6:])
                    if chunk.get("usage"):
                        usage_tokens = chunk["usage"]["completion_tokens"]
                    for c in chunk.get("choices") or ():
                        delta = c.get("delta") or {}
                        if c.get("text") or delta.get("content"):
                            stamps.append(now)
    except CLIENT_ERRORS as e:
        return Result(False, f"{type(e).__name__}: {e}")
    end = time.perf_counter()
    if not stamps:
        return Result(False, "no text streamed")
    return Result(
        ok=True,
        ttft=stamps[0] - t0,
        e2e=end - t0,
        itl=[b - a for a, b in zip(stamps, stamps[1:])],
        output_tokens=usage_tokens if usage_tokens is not None else len(stamps),
        chunks=len(stamps),
    )


def session(base_url: str) -> aiohttp.ClientSession:
    key = os.environ.get("NANOVLLM_API_KEY")
    return aiohttp.ClientSession(
        base_url=base_url, headers={"Authorization": f"Bearer {key}"} if key else {},
        # idle connections close on this side first: uvicorn closes them after 5 s, and a
        # request sent on one it is closing fails
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4),
        timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S))


async def open_connections(client: aiohttp.ClientSession, count: int) -> None:
    """`count` connections opened and left idle in the session's pool (and this process's
    HTTP code run once): as many requests to /health at once."""
    async def health() -> None:
        async with client.get("/health") as resp:
            await resp.read()

    await asyncio.gather(*(health() for _ in range(count)))


async def warm_up(base_url: str, model: str, reqs: list[Request]) -> None:
    """Every prompt once, all at once, 4 tokens each: the engine meets the workload's batch
    shapes (allocator growth, kernel choices) before anything is timed."""
    async with session(base_url) as client:
        results = await asyncio.gather(*(send(client, model, warmup_request(r)) for r in reqs))
    failed = [r.error for r in results if not r.ok]
    if failed:
        print(f"warm-up: {len(failed)} requests failed, e.g. {failed[0]}")


async def drive(base_url, model, reqs, rate, seed, start_at) -> tuple:
    """Send `reqs` as a Poisson process of `rate` from wall time `start_at` (or once the
    connections are open, if later); the results, the wall times this process started and
    its last request ended, and its CPU seconds in between."""
    rng = random.Random(seed)
    # encoded before the start: at rate inf, a burst's first request goes out only after
    # every task of the burst has run to its first wait (asyncio runs them in turn)
    bodies = [encode_body(model, r) for r in reqs]
    async with session(base_url) as client:
        # a connection for each stream, opened before the start, as a long-running client
        # holds them: without, a burst's first request reaches the engine only after the
        # connects of every request of the process
        await open_connections(client, len(reqs))
        await asyncio.sleep(max(0.0, start_at - time.time()))
        started, cpu0 = time.time(), time.process_time()
        tasks = []
        for req, body in zip(reqs, bodies):
            tasks.append(asyncio.create_task(send(client, model, req, body)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return results, started, time.time(), time.process_time() - cpu0


def drive_shard(*a) -> tuple:
    return asyncio.run(drive(*a))


def run_rate(client_procs: int, base_url: str, model: str, reqs: list[Request],
             rate: float) -> dict:
    """One rate. With --client-procs P, P processes each send every P-th request at rate/P
    (P independent Poisson processes add up to one of the full rate)."""
    procs = min(client_procs, len(reqs))
    start_at = time.time() + (3.0 if procs > 1 else 0.0)  # time for the workers to start
    if procs == 1:
        parts = [drive_shard(base_url, model, reqs, rate, SEED + 1, start_at)]
    else:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(procs, mp_context=ctx) as pool:
            futures = [
                pool.submit(
                    drive_shard, base_url, model, reqs[i::procs], rate / procs,
                    SEED + 1 + i, start_at,
                )
                for i in range(procs)
            ]  # fmt: skip
            parts = [f.result() for f in futures]
    results: list = [None] * len(reqs)
    for i, (part, _, _, _) in enumerate(parts):
        results[i::procs] = part
    # from the first process's start: opening connections is not timed
    start = min(started for _, started, _, _ in parts)
    duration = max(end for _, _, end, _ in parts) - start
    cpu = max(cpu for _, _, _, cpu in parts)  # the busiest client process
    return summarize(rate, results, reqs, duration, cpu)


def warmup_request(req: Request) -> Request:
    return Request(dict(req.body, max_tokens=4), req.path, req.prompt, 4)


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    xs = sorted(values)

    def pct(q: float) -> float:  # linear interpolation, as numpy's default
        k = (len(xs) - 1) * q / 100
        lo, hi = math.floor(k), math.ceil(k)
        return 1000 * (xs[lo] + (xs[hi] - xs[lo]) * (k - lo))

    return {"mean": 1000 * sum(xs) / len(xs), "p50": pct(50), "p90": pct(90), "p99": pct(99)}


def summarize(rate, results: list["Result"], reqs, duration: float, cpu: float) -> dict:
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    out_tokens = sum(r.output_tokens for r in ok)
    wrong_len = sum(r.output_tokens != q.output_len for r, q in zip(results, reqs) if r.ok)
    return {
        "rate": "inf" if math.isinf(rate) else rate,
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors,
        "wrong_length": wrong_len,
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "output_tokens": out_tokens,
        "tokens_per_chunk": out_tokens / max(1, sum(r.chunks for r in ok)),
        "ttft_ms": percentiles([r.ttft for r in ok]),
        "itl_ms": percentiles([x for r in ok for x in r.itl]),
        "tpot_ms": percentiles(
            [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
        ),
        "e2e_ms": percentiles([r.e2e for r in ok]),
        "client_cpu_frac": cpu / duration,
    }
