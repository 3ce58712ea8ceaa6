"""Serving benchmark: Poisson arrivals against the OpenAI-compatible server.

    python benchmarks/serve.py --launch "--device cpu --max-num-seqs 16" --rates 1,2,4,inf
    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --rates 2,8,inf --num-prompts 256
    python benchmarks/serve.py --launch "--max-num-seqs 256" --offline   # + LLM.generate

For each rate the same prompts are sent with exponential gaps (a Poisson process, seeded);
`inf` sends them all at once, which saturates the server. Every request streams
(`stream_options.include_usage`), so per request we time the first token (TTFT), the gap
between successive streamed pieces (inter-token latency, ITL), the time per output token
after the first (TPOT) and the end to end latency (E2E). Output lengths are fixed
(`ignore_eos`), so every rate and the offline run do the same work. Before anything is
timed, a warm-up set of prompts of the same lengths is sent once for 4 tokens (the offline
run does the same): the first batch of a new shape is much slower (allocator growth, kernel
choice) and would otherwise land in whichever run comes first. The warm-up and every rate
use their own prompts, so none is served from a prefix cache another filled; the offline
run uses the prompts of rate inf.

Reported per rate: requests/s and output tokens/s (over the time from the first send to the
last response), and p50 / p90 / p99 of TTFT, ITL, TPOT and E2E in ms. `--out` gets the JSON,
`--plot` a PNG of the latency percentiles against the request rate (needs matplotlib:
`pip install matplotlib`, or `pip install -e '.[bench]'`).

`--offline` (with `--launch`): after the server runs, the server is stopped and the same
prompts go through `nanovllm.LLM.generate` with the same engine arguments, to show how close
the server's saturated throughput (rate inf) comes to offline's.

Workloads: `--dataset random` (default) sends `--input-len` random token ids to
/v1/completions; `--dataset chat` sends seeded chat questions to /v1/chat/completions. Both
ask for `--output-len` tokens; `--range-ratio` spreads both lengths uniformly by that fraction.

The client is an asyncio process with httpx and no SDK; its CPU use is reported per rate,
and a warning is printed when it nears one core (the client, not the server, would then be
the bottleneck): `--client-procs P` then spreads the requests over P client processes.
"""

import argparse
import asyncio
import dataclasses
import json
import math
import multiprocessing
import os
import platform
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

SUBJECTS = [
    "the ocean", "volcanoes", "honeybees", "the Roman empire", "black holes", "bread baking",
    "chess", "glaciers", "the printing press", "octopuses", "jazz", "solar panels", "deserts",
    "the internet", "rainforests", "trains", "origami", "the moon", "tea", "robots",
]  # fmt: skip
TASKS = [
    "Write a detailed essay about {}.",
    "Explain {} to a curious ten-year-old, with examples.",
    "Tell a long story in which {} plays a central part.",
    "List everything you know about {}, one point per line.",
    "Describe the history of {} in as much detail as you can.",
]


WORKLOAD_KEYS = (
    "dataset num_prompts input_len output_len range_ratio temperature seed max_concurrency "
    "client_procs"
).split()


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


# ---- workload ---------------------------------------------------------------------------------


def spread(rng: random.Random, n: int, ratio: float) -> int:
    return max(1, rng.randint(math.floor(n * (1 - ratio)), math.ceil(n * (1 + ratio))))


def make_requests(args: argparse.Namespace, seed: int) -> list[Request]:
    rng = random.Random(seed)
    reqs = []
    for i in range(args.num_prompts):
        out_len = spread(rng, args.output_len, args.range_ratio)
        common = {"max_tokens": out_len, "temperature": args.temperature, "ignore_eos": True}
        if args.dataset == "random":
            lo, hi = args.token_range
            length = spread(rng, args.input_len, args.range_ratio)
            ids = [rng.randint(lo, hi) for _ in range(length)]
            reqs.append(Request({"prompt": ids, **common}, "/v1/completions", ids, out_len))
        else:
            question = rng.choice(TASKS).format(rng.choice(SUBJECTS)) + f" (#{i})"
            messages = [{"role": "user", "content": question}]
            body = {"messages": messages, **common}
            reqs.append(Request(body, "/v1/chat/completions", messages, out_len))
    return reqs


# ---- one request, one rate --------------------------------------------------------------------


async def send(client: httpx.AsyncClient, model: str, req: Request) -> Result:
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True}, **req.body}
    stamps: list[float] = []
    usage_tokens = None
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", req.path, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                return Result(False, f"HTTP {resp.status_code}: {text[:200]}")
            buf = b""
            async for data in resp.aiter_bytes():
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
    except httpx.HTTPError as e:
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


def http_client(args, base_url: str) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.request_timeout)
    return httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits, timeout=timeout)


async def warm_up(args, base_url: str, model: str, reqs: list[Request]) -> None:
    """Every prompt once, all at once, 4 tokens each: the engine meets the workload's batch
    shapes (allocator growth, kernel choices) before anything is timed."""
    async with http_client(args, base_url) as client:
        results = await asyncio.gather(*(send(client, model, warmup_request(r)) for r in reqs))
    failed = [r.error for r in results if not r.ok]
    if failed:
        print(f"warm-up: {len(failed)} requests failed, e.g. {failed[0]}")


async def drive(args, base_url, model, reqs, rate, seed, start_at) -> tuple[list, float, float]:
    """Send `reqs` as a Poisson process of `rate` from wall time `start_at`; the results, the
    wall time the last one ended, and this process's CPU seconds."""
    rng = random.Random(seed)
    limit = asyncio.Semaphore(args.max_concurrency or len(reqs))

    async def limited(client, req):
        async with limit:
            return await send(client, model, req)

    async with http_client(args, base_url) as client:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        cpu0 = time.process_time()
        tasks = []
        for req in reqs:
            tasks.append(asyncio.create_task(limited(client, req)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return results, time.time(), time.process_time() - cpu0


def drive_shard(*a) -> tuple[list, float, float]:
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
    for i, (part, _, _) in enumerate(parts):
        results[i::procs] = part
    duration = max(end for _, end, _ in parts) - start_at
    cpu = max(cpu for _, _, cpu in parts)  # the busiest client process
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


def summarize(rate, results: list[Result], reqs, duration: float, cpu: float) -> dict:
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


# ---- server launch, offline run ---------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(launch_args: list[str], log_path: Path, timeout: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "nanovllm", "serve", "--port", str(port), *launch_args]
    print("launching:", shlex.join(cmd), f"(log: {log_path})", flush=True)
    proc = subprocess.Popen(cmd, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the server exited with status {proc.returncode}; see {log_path}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(proc)
    sys.exit(f"the server did not become healthy within {timeout:.0f} s; see {log_path}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_offline(
    launch_args: list[str], warm_reqs: list[Request], reqs: list[Request], temperature: float,
    runs: int = 1,
) -> dict:
    """The same prompts through LLM.generate, with the engine arguments the server had;
    `runs` times, reporting the best (and each run's throughput)."""
    from nanovllm import LLM, SamplingParams
    from nanovllm.entrypoints.cli import build_parser, engine_config

    served = build_parser().parse_args(["serve", *launch_args])
    config = engine_config(served)
    llm = LLM(served.model, **dataclasses.asdict(config))
    params = [
        SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=r.output_len)
        for r in reqs
    ]
    warm = SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=4)
    llm.generate([r.prompt for r in warm_reqs], warm, use_tqdm=False)  # as the server's
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        outs = llm.generate([r.prompt for r in reqs], params, use_tqdm=False)
        times.append(time.perf_counter() - start)
        # each run computes every prompt (not an assert: `python -O` would skip the reset)
        if not llm.engine.block_manager.reset_prefix_cache():
            raise RuntimeError("KV blocks still in use after generate(); cannot reset the cache")
    tokens = sum(len(o.token_ids) for o in outs)
    elapsed = min(times)
    return {
        "engine_config": dataclasses.asdict(config),
        "elapsed_s": elapsed,
        "output_tokens": tokens,
        "output_throughput": tokens / elapsed,
        "throughputs": [tokens / t for t in times],
        "request_throughput": len(reqs) / elapsed,
    }


# ---- report -----------------------------------------------------------------------------------


def print_table(runs: list[dict]) -> None:
    head = f"{'rate':>6} {'ok':>5} {'req/s':>7} {'tok/s':>8}"
    for m in ("ttft", "itl", "tpot", "e2e"):
        head += f" | {m + ' p50/p90/p99 ms':>26}"
    print(head)
    for r in runs:
        line = f"{r['rate']!s:>6} {r['completed']:>5} {r['request_throughput']:>7.2f} "
        line += f"{r['output_throughput']:>8.1f}"
        for m in ("ttft", "itl", "tpot", "e2e"):
            p = r[f"{m}_ms"]
            cells = "/".join("-" if p[k] is None else f"{p[k]:.0f}" for k in ("p50", "p90", "p99"))
            line += f" | {cells:>26}"
        print(line)
        if r["failed"]:
            print(f"       {r['failed']} failed: {r['errors']}")
        if r["wrong_length"]:
            print(f"       {r['wrong_length']} responses had a different length than asked")
        if r["client_cpu_frac"] > 0.8:
            print(
                f"       warning: a client process used {r['client_cpu_frac']:.0%} of a core; "
                "its overhead may limit these figures (try --client-procs)"
            )


def plot(runs: list[dict], path: Path, title: str, offline: dict | None) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is missing; pip install matplotlib (or -e '.[bench]')")
        return
    xs = list(range(len(runs)))
    labels = [str(r["rate"]) for r in runs]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    for ax, (metric, name) in zip(
        axes, [("ttft_ms", "TTFT"), ("itl_ms", "inter-token latency"), ("e2e_ms", "end to end")]
    ):
        for q, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
            ax.plot(xs, [r[metric][q] for r in runs], style, label=q)
        ax.set_title(f"{name} (ms)")
        ax.set_yscale("log")
        ax.legend()
    ax = axes[3]
    ax.plot(xs, [r["output_throughput"] for r in runs], "o-", label="server")
    if offline:
        offline_tps = offline["output_throughput"]
        ax.axhline(offline_tps, color="gray", ls="--", label="offline LLM.generate")
    ax.set_title("output tokens/s")
    ax.legend()
    for ax in axes:
        ax.set_xticks(xs, labels)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


# ---- main -------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000", help="a running server")
    ap.add_argument(
        "--launch",
        metavar="ARGS",
        default=None,
        help='start `nanovllm serve ARGS` on a free port instead (e.g. "--device cpu")',
    )
    ap.add_argument("--launch-timeout", type=float, default=600)
    ap.add_argument("--api-key", default=os.environ.get("NANOVLLM_API_KEY"))
    ap.add_argument("--model-name", default=None, help="default: the first of /v1/models")
    ap.add_argument("--rates", default="1,2,4,inf", help="requests/s, comma-separated; inf")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--dataset", choices=["random", "chat"], default="random")
    ap.add_argument("--input-len", type=int, default=128, help="random dataset: prompt tokens")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--range-ratio", type=float, default=0.0)
    ap.add_argument(
        "--token-range",
        type=lambda s: tuple(int(x) for x in s.split(",")),
        default=(100, 10000),
        help="random dataset: token ids drawn from LO,HI",
    )
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-concurrency", type=int, default=None, help="per client process")
    ap.add_argument(
        "--client-procs",
        type=int,
        default=1,
        help="client processes (when one client core cannot keep up with the server)",
    )
    ap.add_argument("--request-timeout", type=float, default=1800)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--offline", action="store_true", help="also run LLM.generate (needs --launch)")
    ap.add_argument("--offline-runs", type=int, default=1,
                    help="offline runs (the best counts): a shared host's speed varies by run")
    ap.add_argument("--out", type=Path, default=Path("serve_bench.json"))
    ap.add_argument("--plot", type=Path, default=None, help="PNG path (default: --out as .png)")
    args = ap.parse_args()
    if args.offline and args.launch is None:
        ap.error("--offline needs --launch, so that both runs use the same engine arguments")
    return args


def main() -> None:
    args = parse_args()
    rates = [math.inf if r.strip() in ("inf", "Inf") else float(r) for r in args.rates.split(",")]
    # distinct prompts (same length distribution) for the warm-up and for each rate, so no
    # run is served from the prefix cache another run filled; offline gets the inf rate's
    warm_reqs = make_requests(args, args.seed)
    rate_reqs = [make_requests(args, args.seed + 1 + i) for i in range(len(rates))]
    reqs = rate_reqs[rates.index(math.inf)] if math.inf in rates else rate_reqs[-1]
    launch_args = shlex.split(args.launch) if args.launch is not None else None
    proc, base_url = None, args.base_url.rstrip("/")
    if launch_args is not None:
        log = Path(tempfile.mkstemp(prefix="nanovllm-serve-", suffix=".log")[1])
        proc, base_url = launch(launch_args, log, args.launch_timeout)
    try:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        models = httpx.get(base_url + "/v1/models", headers=headers, timeout=30).json()
        model = args.model_name or models["data"][0]["id"]
        print(f"server {base_url}, model {model}, {len(reqs)} {args.dataset} prompts", flush=True)
        asyncio.run(warm_up(args, base_url, model, warm_reqs))
        runs = []
        for rate, rate_set in zip(rates, rate_reqs):
            runs.append(run_rate(args, base_url, model, rate_set, rate))
            print_table(runs[-1:])
    finally:
        if proc is not None:
            stop(proc)
    offline = None
    if args.offline:
        offline = run_offline(launch_args, warm_reqs, reqs, args.temperature, args.offline_runs)
        each = ", ".join(f"{t:.1f}" for t in offline["throughputs"])
        print(f"offline LLM.generate: {each} output tok/s")
    print()
    print_table(runs)
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPUs",
        "base_url": base_url,
        "launch_args": launch_args,
        "model": model,
        "workload": {k: getattr(args, k) for k in WORKLOAD_KEYS},
        "runs": runs,
        "offline": offline,
    }
    saturated = [r for r in runs if r["rate"] == "inf"]
    if offline and saturated:  # best against best: noise on a shared host only slows a run
        ratio = max(r["output_throughput"] for r in saturated) / offline["output_throughput"]
        report["server_over_offline"] = ratio
        verdict = "within" if ratio >= 0.9 else "NOT within"
        print(f"server at rate inf / offline throughput (best runs): {ratio:.3f} "
              f"({verdict} 10%)")
    args.out.write_text(json.dumps(report, indent=2))
    print(f"results: {args.out}")
    title = f"{model}, {args.dataset} {args.input_len}->{args.output_len}, {len(reqs)} prompts"
    plot(runs, args.plot or args.out.with_suffix(".png"), title, offline)


if __name__ == "__main__":
    main()
