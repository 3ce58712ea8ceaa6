"""sglang-router's cache-aware policy against round robin, in front of nano-vLLM servers, on
a shared-prefix workload: prefix-cache hit rate and TTFT.

    python -m benchmarks.router                       # 2 CPU servers, the default model
    python -m benchmarks.router --launch "--device cuda --max-num-seqs 256" --workers 2

For each policy: --workers fresh `nanovllm serve` processes (each with --launch's flags),
then `python -m sglang_router.launch_router --policy P` in front of them, then the same
requests: --docs documents of about 300 words, 96 requests, each a document (a seeded random
draw) and its own question, sent 4 at a time through the router, streamed, 4 tokens each.
Each server's KV cache holds about its share of the documents' prompts (--docs / --workers;
unless --launch sets --num-kv-blocks), so the documents fit in the servers' caches together
but not in one: the case a cache-aware router is for.
The hit rate is the servers' own count
(nanovllm:prefix_cache_hits / nanovllm:prefix_cache_queries from each /metrics, summed): the
share of prompt tokens served from a prefix cache. TTFT is timed at the client.
"""

import argparse
import asyncio
import json
import math
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.serve import free_port, launch, stop
from benchmarks.workloads import SUBJECTS, TASKS

POLICIES = ("cache_aware", "round_robin")
DOC_WORDS = 300
MAX_TOKENS = 4
REQUESTS, CONCURRENCY = 96, 4  # sent through the router, that many at a time


def counter(text: str, name: str) -> float:
    """Sum of a counter's samples in Prometheus text (every label)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "_total") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def cache_blocks(launch: list[str], prompts: list[str], docs: int, concurrency: int) -> int:
    """KV blocks for `docs` documents' prompts (their mean length in the served model's
    tokens, chat template included) plus a block for each request running at once."""
    from nanovllm.engine.resolve import BLOCK_SIZE
    from nanovllm.engine.tokenizer import load_tokenizer
    from nanovllm.model.loader.source import open_model

    def flag(name: str, default):
        return launch[launch.index(name) + 1] if name in launch else default

    tok = load_tokenizer(open_model(flag("--model", None)))
    block_size = int(flag("--block-size", BLOCK_SIZE))
    tokens = statistics.mean(
        len(tok.render_chat([{"role": "user", "content": p}])) for p in prompts)
    return math.ceil(docs * tokens / block_size) + concurrency


def documents(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    vocab = " ".join(TASKS + SUBJECTS).split()
    return [" ".join(rng.choice(vocab) for _ in range(words)) for _ in range(n)]


async def one(client: httpx.AsyncClient, url: str, model: str, text: str,
              max_tokens: int) -> float:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "stream": True,
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    ttft = None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if ttft is None and line.startswith("data: {") and '"content"' in line:
                ttft = time.perf_counter() - start
    return ttft if ttft is not None else time.perf_counter() - start


async def drive(url: str, model: str, prompts: list[str], concurrency: int,
                max_tokens: int) -> list[float]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        async def bounded(text: str) -> float:
            async with sem:
                return await one(client, url, model, text, max_tokens)
        return await asyncio.gather(*(bounded(p) for p in prompts))


def run_policy(policy: str, args, prompts: list[str], logs: Path) -> dict:
    workers = [launch(shlex.split(args.launch), logs / f"{policy}-worker{i}.log", 600)
               for i in range(args.workers)]
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
           "--port", str(port), "--policy", policy, "--log-level", "warn",
           "--worker-urls", *(u for _, u in workers)]
    router = subprocess.Popen(cmd, stdout=open(logs / f"{policy}-router.log", "wb"),
                              stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            try:
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        model = httpx.get(workers[0][1] + "/v1/models").json()["data"][0]["id"]
        start = time.perf_counter()
        ttfts = sorted(asyncio.run(drive(url, model, prompts, CONCURRENCY,
                                         MAX_TOKENS)))
        wall = time.perf_counter() - start
        texts = [httpx.get(u + "/metrics").text for _, u in workers]
    finally:
        router.terminate()
        router.wait(30)
        for proc, _ in workers:
            stop(proc)
    hits = sum(counter(t, "nanovllm:prefix_cache_hits") for t in texts)
    queries = sum(counter(t, "nanovllm:prefix_cache_queries") for t in texts)
    per_worker = [counter(t, "nanovllm:request_success") for t in texts]
    return {"policy": policy, "hit_rate": hits / queries, "requests_per_worker": per_worker,
            "ttft_p50_s": statistics.median(ttfts),
            "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))], "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launch", default="--device cpu --max-model-len 2048",
                    help="flags of each `nanovllm serve`")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--docs", type=int, default=32)
    ap.add_argument("--out", help="write the figures to this JSON file")
    args = ap.parse_args()

    docs = documents(args.docs, DOC_WORDS, seed=0)
    rng = random.Random(1)
    prompts = [f"{rng.choice(docs)}\n\nQuestion {i}: summarize the text above in one line."
               for i in range(REQUESTS)]
    cache_docs = args.docs // args.workers
    launch = shlex.split(args.launch)
    if cache_docs and "--num-kv-blocks" not in launch:
        blocks = cache_blocks(launch, prompts, cache_docs, CONCURRENCY)
        args.launch += f" --num-kv-blocks {blocks}"
        print(f"each server's KV cache: {blocks} blocks, about {cache_docs} of the "
              f"{args.docs} documents")
    logs = Path(tempfile.mkdtemp(prefix="nanovllm-router-"))
    results = [run_policy(p, args, prompts, logs) for p in POLICIES]
    print(f"{REQUESTS} requests over {args.docs} documents of {DOC_WORDS} words, "
          f"{CONCURRENCY} at a time, {args.workers} workers ({args.launch}); logs {logs}")
    for r in results:
        print(f"  {r['policy']:<12} prefix-cache hit rate {r['hit_rate']:6.1%}  TTFT p50 "
              f"{r['ttft_p50_s'] * 1e3:7.0f} ms  p90 {r['ttft_p90_s'] * 1e3:7.0f} ms  wall "
              f"{r['wall_s']:6.1f} s  requests per worker {r['requests_per_worker']}")
    a, b = results
    print(f"  {a['policy']} / {b['policy']}: hit rate {a['hit_rate'] / b['hit_rate']:.2f}x, "
          f"TTFT p50 {b['ttft_p50_s'] / a['ttft_p50_s']:.2f}x lower")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
