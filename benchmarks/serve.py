"""Serving benchmark: Poisson arrivals against the OpenAI-compatible server.

    python -m benchmarks.serve --launch "--device cpu --max-num-seqs 16" --rates 1,2,4,inf
    python -m benchmarks.serve --base-url http://127.0.0.1:8000 --rates 2,8,inf --num-prompts 256
    python -m benchmarks.serve --launch "--max-num-seqs 256" --offline   # + LLM.generate

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
the server's saturated throughput (rate inf) comes to offline's (issue 11's goal: 0.95).
With several `inf` rates and `--offline-runs N`, the ratio is given best/best and mean/mean,
with each side's run-to-run spread and how many runs of each that spread needs for a 5%
change to stand out (serve_report.runs_to_resolve). With `--launch`, each rate also reports
each server process's busy cores and CPU time per output token (front end, engine
processes, tensor-parallel ranks; read from /proc): at saturation, a process near one whole
core is the one the server is bound by, the client's share is reported as before. Each rate
also reports the engine steps it took, and those with prompt tokens (from /metrics; the
offline runs report theirs): the same work in more, smaller steps is time offline saves.

Workloads: `--dataset random` (default) sends `--input-len` random token ids to
/v1/completions; `--dataset chat` sends seeded chat questions to /v1/chat/completions. Both
ask for `--output-len` tokens; `--range-ratio` spreads both lengths uniformly by that fraction.

The client is an asyncio process with aiohttp (or `--client httpx`) and no SDK; its CPU use
is reported per rate, and a warning is printed when it nears one core (the client, not the
server, would then be the bottleneck): `--client-procs P` then spreads the requests over P
client processes. With httpx each process spreads its requests over clients of
`--streams-per-client` (16): one httpx client carrying hundreds of streams spends its CPU
scanning its connection pool. Each rate reports the client's timeline (when requests went
out, the first text, the first and last end) and the engine's idle time in each second of
the run (/metrics sampled every 0.1 s): idle at the start or end of a saturated run is time
the engine waited on the client or the front ends.
The client is serve_client.py, each rate's figures, table and plot serve_report.py, the
prompts workloads.py, what the server reports of its processes and engines serve_probe.py.
"""

import argparse
import asyncio
import dataclasses
import json
import math
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.serve_client import STREAMS_PER_CLIENT, Request, run_rate, warm_up
from benchmarks.serve_probe import (
    IdleSampler,
    engine_counters,
    loop_line,
    process_cpu,
    report_idle,
    report_server_cpu,
    report_steps,
)
from benchmarks.serve_report import plot, print_ratio, print_table
from benchmarks.workloads import length_range, random_requests, text_requests

SERVE_GOAL = 0.95  # issue 11: saturated serving at >= 0.95 of offline throughput
WORKLOAD_KEYS = (
    "dataset num_prompts input_len output_len range_ratio temperature seed max_concurrency "
    "client_procs"
).split()


# ---- workload ---------------------------------------------------------------------------------


def make_requests(args: argparse.Namespace, seed: int) -> list[Request]:
    out_lens = length_range(args.output_len, args.range_ratio)

    def common(out_len: int) -> dict:
        return {"max_tokens": out_len, "temperature": args.temperature, "ignore_eos": True}

    if args.dataset == "random":
        in_lens = length_range(args.input_len, args.range_ratio)
        pairs = random_requests(args.num_prompts, in_lens, out_lens, args.token_range, seed)
        return [
            Request({"prompt": ids, **common(n)}, "/v1/completions", ids, n) for ids, n in pairs
        ]
    reqs = []
    for question, n in text_requests(args.num_prompts, out_lens, seed):
        messages = [{"role": "user", "content": question}]
        reqs.append(Request({"messages": messages, **common(n)}, "/v1/chat/completions",
                            messages, n))
    return reqs


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
    if config.trace:  # the server's trace stays; the offline runs get their own file
        config = dataclasses.replace(config, trace=f"{config.trace}.offline.jsonl")
    llm = LLM(served.model, **dataclasses.asdict(config))
    params = [
        SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=r.output_len)
        for r in reqs
    ]
    warm = SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=4)
    llm.generate([r.prompt for r in warm_reqs], warm, use_tqdm=False)  # as the server's
    times, steps, loops = [], [], []
    engine = llm.engine
    for _ in range(runs):
        start = time.perf_counter()
        steps0, prefill0 = engine.num_steps, engine.num_prefill_steps
        timing0 = dict(engine.timing)
        outs = llm.generate([r.prompt for r in reqs], params, use_tqdm=False)
        times.append(time.perf_counter() - start)
        steps.append((engine.num_steps - steps0, engine.num_prefill_steps - prefill0))
        loops.append({p: engine.timing[p] - timing0[p] for p in engine.timing})
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
        "engine_steps": steps,  # (steps, steps with prompt tokens) per run
        "engine_loop_s": loops,  # seconds per phase (LOOP_PHASES) per run
        "elapsed_each_s": times,
        "request_throughput": len(reqs) / elapsed,
    }


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
    ap.add_argument(
        "--client", choices=("aiohttp", "httpx"), default="aiohttp",
        help="the HTTP client each client process sends through (aiohttp, the default, "
        "costs about half of httpx's CPU a streamed token: BENCHMARKS.md)",
    )
    ap.add_argument(
        "--streams-per-client", type=int, default=STREAMS_PER_CLIENT,
        help="concurrent requests per httpx client in a client process (0: one client for "
        "all): a client's pool scans all its connections as each request starts or ends",
    )
    ap.add_argument(
        "--warm-connections", action=argparse.BooleanOptionalAction, default=True,
        help="open each client process's connections (one per concurrent request) before "
        "a rate's start, as a long-running client holds them (default); "
        "--no-warm-connections connects inside the timed run",
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
    if args.client == "aiohttp":
        try:
            import aiohttp  # noqa: F401
        except ImportError:
            ap.error("--client aiohttp (the default) needs aiohttp: pip install -e '.[bench]', "
                     "or pass --client httpx")
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
            before = process_cpu(proc.pid, log) if proc is not None else {}
            counters = engine_counters(base_url, headers)
            with IdleSampler(base_url, headers) as sampler:
                runs.append(run_rate(args, base_url, model, rate_set, rate))
            print_table(runs[-1:])
            report_idle(sampler, runs[-1])
            if before:
                report_server_cpu(before, process_cpu(proc.pid, log), runs[-1])
            report_steps(counters, engine_counters(base_url, headers), runs[-1])
    finally:
        if proc is not None:
            stop(proc)
    offline = None
    if args.offline:
        offline = run_offline(launch_args, warm_reqs, reqs, args.temperature, args.offline_runs)
        each = ", ".join(f"{t:.1f}" for t in offline["throughputs"])
        steps = ", ".join(f"{a} ({b} with prompt tokens)" for a, b in offline["engine_steps"])
        print(f"offline LLM.generate: {each} output tok/s; engine steps {steps}")
        for loop, wall in zip(offline["engine_loop_s"], offline["elapsed_each_s"]):
            print(f"       offline engine: {loop_line(loop, wall)}")
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
    saturated = [r["output_throughput"] for r in runs if r["rate"] == "inf"]
    if offline and saturated:  # best against best: noise on a shared host only slows a run
        stats = print_ratio(saturated, offline["throughputs"], SERVE_GOAL)
        report["server_over_offline"] = stats["best_over_best"]
        report["server_over_offline_stats"] = stats
    args.out.write_text(json.dumps(report, indent=2))
    print(f"results: {args.out}")
    title = f"{model}, {args.dataset} {args.input_len}->{args.output_len}, {len(reqs)} prompts"
    plot(runs, args.plot or args.out.with_suffix(".png"), title, offline)


if __name__ == "__main__":
    main()
