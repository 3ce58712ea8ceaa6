"""The serving benchmark's client (benchmarks/serve.py): streamed requests over HTTP, sent
as a Poisson process from one or more processes, and each rate's latencies and throughput.

--client-procs' spawned processes run drive_shard from this module, not from serve.py's
__main__.
"""

import asyncio
import contextlib
import json
import math
import multiprocessing
import random
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import httpx

from benchmarks.serve_report import summarize, timeline


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
    sent_at: float = 0.0  # wall clock (time.time()): the request's start, first text, end
    first_at: float | None = None
    ended_at: float | None = None


JSON_HEADERS = {"content-type": "application/json"}
try:  # what a failed request raises, with either client
    import aiohttp

    CLIENT_ERRORS: tuple = (httpx.HTTPError, aiohttp.ClientError, asyncio.TimeoutError)
except ImportError:
    CLIENT_ERRORS = (httpx.HTTPError,)


def encode_body(model: str, req: Request) -> bytes:
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True}, **req.body}
    return json.dumps(body).encode()


@contextlib.asynccontextmanager
async def _post(client, path: str, body: bytes):
    """POST `body` and stream the reply, with either HTTP client: (status, an async iterator
    over the body's bytes as they come, a coroutine function reading the rest)."""
    if isinstance(client, httpx.AsyncClient):
        async with client.stream("POST", path, content=body, headers=JSON_HEADERS) as resp:
            yield resp.status_code, resp.aiter_bytes(), resp.aread
    else:  # an aiohttp.ClientSession
        async with client.post(path, data=body, headers=JSON_HEADERS) as resp:
            yield resp.status, resp.content.iter_any(), resp.read


async def send(client, model: str, req: Request, body: bytes | None = None) -> Result:
    """One streamed request over `client` (httpx or aiohttp, see http_clients); `body`, its
    JSON encoded ahead of time (encode_body), keeps a burst's requests from waiting on each
    other's encoding."""
    if body is None:
        body = encode_body(model, req)
    stamps: list[float] = []
    usage_tokens = None
    sent_at, t0 = time.time(), time.perf_counter()
    try:
        async with _post(client, req.path, body) as (status, chunks, read_rest):
            if status != 200:
                text = (await read_rest()).decode(errors="replace")
                return Result(False, f"HTTP {status}: {text[:200]}", sent_at=sent_at)
            buf = b""
            async for data in chunks:
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
        return Result(False, f"{type(e).__name__}: {e}", sent_at=sent_at)
    end = time.perf_counter()
    if not stamps:
        return Result(False, "no text streamed", sent_at=sent_at)
    return Result(
        ok=True,
        ttft=stamps[0] - t0,
        e2e=end - t0,
        itl=[b - a for a, b in zip(stamps, stamps[1:])],
        output_tokens=usage_tokens if usage_tokens is not None else len(stamps),
        chunks=len(stamps),
        sent_at=sent_at,
        first_at=sent_at + stamps[0] - t0,
        ended_at=sent_at + end - t0,
    )


# requests one httpx client carries at once: its connection pool scans every connection it
# holds each time a request starts or ends (httpcore's _assign_requests_to_connections), so
# one client carrying a burst of 256 streams spent most of its process's CPU there (4.6 of
# 5.7 s in a profile) and read the streams late; clients of 16 keep that scan short
STREAMS_PER_CLIENT = 16


def _auth(args) -> dict:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


def http_client(args, base_url: str) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.request_timeout)
    return httpx.AsyncClient(base_url=base_url, headers=_auth(args), limits=limits,
                             timeout=timeout)


def aiohttp_session(args, base_url: str):
    import aiohttp

    return aiohttp.ClientSession(
        base_url=base_url, headers=_auth(args),
        # idle connections close on this side first: uvicorn closes them after 5 s, and a
        # request sent on one it is closing fails
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4),
        timeout=aiohttp.ClientTimeout(total=args.request_timeout))


@contextlib.asynccontextmanager
async def http_clients(args, base_url: str, concurrent: int):
    """The clients a process sends through: with --client httpx, enough clients for
    `concurrent` streams at args.streams_per_client each (0: one); with aiohttp, one session
    (its connector hands out idle connections without scanning them all)."""
    async with contextlib.AsyncExitStack() as stack:
        if args.client == "aiohttp":
            clients = [aiohttp_session(args, base_url)]
        else:
            n = max(1, math.ceil(concurrent / (args.streams_per_client or concurrent)))
            clients = [http_client(args, base_url) for _ in range(n)]
        yield [await stack.enter_async_context(c) for c in clients]


async def open_connections(clients: list, count: int) -> None:
    """`count` connections on each client, opened and left idle in its pool (and this
    process's HTTP code run once): as many requests to /health at once."""
    async def health(client) -> None:
        if isinstance(client, httpx.AsyncClient):
            (await client.get("/health")).raise_for_status()
        else:
            async with client.get("/health") as resp:
                await resp.read()

    await asyncio.gather(*(health(c) for c in clients for _ in range(count)))


async def warm_up(args, base_url: str, model: str, reqs: list[Request]) -> None:
    """Every prompt once, all at once, 4 tokens each: the engine meets the workload's batch
    shapes (allocator growth, kernel choices) before anything is timed."""
    async with http_clients(args, base_url, len(reqs)) as clients:
        results = await asyncio.gather(*(
            send(clients[i % len(clients)], model, warmup_request(r)) for i, r in enumerate(reqs)
        ))
    failed = [r.error for r in results if not r.ok]
    if failed:
        print(f"warm-up: {len(failed)} requests failed, e.g. {failed[0]}")


async def drive(args, base_url, model, reqs, rate, seed, start_at) -> tuple:
    """Send `reqs` as a Poisson process of `rate` from wall time `start_at` (or once the
    connections are open, if later); the results, the wall times this process started and
    its last request ended, and its CPU seconds in between."""
    rng = random.Random(seed)
    limit = asyncio.Semaphore(args.max_concurrency or len(reqs))

    async def limited(client, req, body):
        async with limit:
            return await send(client, model, req, body)

    # encoded before the start: at rate inf, a burst's first request goes out only after
    # every task of the burst has run to its first wait (asyncio runs them in turn)
    bodies = [encode_body(model, r) for r in reqs]
    concurrent = args.max_concurrency or len(reqs)
    async with http_clients(args, base_url, concurrent) as clients:
        if args.warm_connections:
            # a connection for each stream, opened (and this process's HTTP code run once)
            # before the start, as a long-running client holds them: without, the burst's
            # first request reached the engine ~0.4 s into the run, after the connects
            # and first steps of every request of the process (BENCHMARKS.md)
            await open_connections(clients, math.ceil(concurrent / len(clients)))
        await asyncio.sleep(max(0.0, start_at - time.time()))
        started, cpu0 = time.time(), time.process_time()
        tasks = []
        for i, (req, body) in enumerate(zip(reqs, bodies)):
            client = clients[i % len(clients)]
            tasks.append(asyncio.create_task(limited(client, req, body)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return results, started, time.time(), time.process_time() - cpu0


def drive_shard(*a) -> tuple:
    return asyncio.run(drive(*a))


def run_rate(args, base_url: str, model: str, reqs: list[Request], rate: float) -> dict:
    """One rate. With --client-procs P, P processes each send every P-th request at rate/P
    (P independent Poisson processes add up to one of the full rate)."""
    procs = min(args.client_procs, len(reqs))
    start_at = time.time() + (3.0 if procs > 1 else 0.0)  # time for the workers to start
    if procs == 1:
        parts = [drive_shard(args, base_url, model, reqs, rate, args.seed + 1, start_at)]
    else:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(procs, mp_context=ctx) as pool:
            futures = [
                pool.submit(
                    drive_shard, args, base_url, model, reqs[i::procs], rate / procs,
                    args.seed + 1 + i, start_at,
                )
                for i in range(procs)
            ]  # fmt: skip
            parts = [f.result() for f in futures]
    results: list = [None] * len(reqs)
    for i, (part, _, _, _) in enumerate(parts):
        results[i::procs] = part
    # from the first process's start: opening connections (--warm-connections) is not timed
    start = min(started for _, started, _, _ in parts)
    duration = max(end for _, _, end, _ in parts) - start
    cpu = max(cpu for _, _, _, cpu in parts)  # the busiest client process
    run = summarize(rate, results, reqs, duration, cpu)
    run["start_at"] = start
    run["timeline_s"] = timeline(results, start)
    return run


def warmup_request(req: Request) -> Request:
    return Request(dict(req.body, max_tokens=4), req.path, req.prompt, 4)
