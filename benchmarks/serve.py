"""Serving benchmark: Poisson arrivals against the OpenAI-compatible server.

    python -m benchmarks.serve --launch "--device cpu --max-num-seqs 16" --rates 1,2,4,inf
    python -m benchmarks.serve --base-url http://127.0.0.1:8000 --rates 2,8,inf --num-prompts 256
    python -m benchmarks.serve --launch "--max-num-seqs 256" --offline   # + LLM.generate
    python -m benchmarks.serve --launch "--model DIR --max-num-seqs 256 --max-model-len 4096" \
        --rates inf,inf --num-prompts 256 --input-len 512 --output-len 256 --range-ratio 0.5 \
        --client-procs 4 --offline 2        # the H200's server / offline figure

For each rate the same number of prompts (`--input-len` random token ids to
/v1/completions, `--output-len` tokens asked for each; `--range-ratio` spreads both lengths
uniformly by that fraction) are sent with exponential gaps (a Poisson process, seeded);
`inf` sends them all at once, which saturates the server. Every request streams
(`stream_options.include_usage`), so per request we time the first token (TTFT), the gap
between successive streamed pieces (inter-token latency, ITL), the time per output token
after the first (TPOT) and the end to end latency (E2E). Output lengths are fixed
(`ignore_eos`), so every rate and the offline run do the same work. Before anything is
timed, a warm-up set of prompts of the same lengths is sent once for 4 tokens (the offline
run does the same): the first batch of a new shape is much slower (allocator growth, kernel
choice) and would otherwise land in whichever run comes first. The warm-up and every rate
use their own prompts, so none is served from a prefix cache another filled; the offline
run uses the prompts of rate inf. A server that wants a key gets $NANOVLLM_API_KEY.

Reported per rate: requests/s and output tokens/s (over the time from the first send to the
last response), and p50 / p90 / p99 of TTFT, ITL, TPOT and E2E in ms. `--out` gets the JSON,
and beside it a PNG of the latency percentiles against the request rate (needs matplotlib:
`pip install -e '.[bench]'`).

`--offline` (with `--launch`): after the server runs, the server is stopped and the same
prompts go through `nanovllm.LLM.generate` with the same engine arguments, to show how close
the server's saturated throughput (rate inf) comes to offline's (issue 11's goal: 0.95).
With several `inf` rates and `--offline N` (N runs), the ratio is given best/best and mean/mean,
with each side's run-to-run spread and how many runs of each that spread needs for a 5%
change to stand out (serve_report.runs_to_resolve). With `--launch`, each rate also reports
each server process's busy cores and CPU time per output token (front end, engine
processes, tensor-parallel ranks; read from /proc): at saturation, a process near one whole
core is the one the server is bound by. Each rate also reports the engine steps it took and
where the engine loop's time went (from /metrics; the offline runs report theirs): the same
work in more, smaller steps is time offline saves.

The client is an asyncio process with aiohttp and no SDK (serve_client.py); its CPU use is
reported per rate, and a warning is printed when it nears one core (the client, not the
server, would then be the bottleneck): `--client-procs P` then spreads the requests over P
client processes. The table and plot are serve_report.py's, what the server reports of its
processes and engines serve_probe.py's.
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

from benchmarks.serve_client import SEED, Request, run_rate, warm_up
from benchmarks.serve_probe import (
    engine_counters,
    loop_line,
    process_cpu,
    report_server_cpu,
    report_steps,
)
from benchmarks.serve_report import plot, print_ratio, print_table
from benchmarks.workloads import length_range, random_requests

SERVE_GOAL = 0.95  # issue 11: saturated serving at >= 0.95 of offline throughput
WORKLOAD_KEYS = "num_prompts input_len output_len range_ratio client_procs".split()
TOKEN_IDS = (100, 10000)  # the prompts' token ids, drawn from this range
LAUNCH_TIMEOUT_S = 600


# ---- workload ---------------------------------------------------------------------------------


def make_requests(args: argparse.Namespace, seed: int) -> list[Request]:
    out_lens = length_range(args.output_len, args.range_ratio)
    in_lens = length_range(args.input_len, args.range_ratio)
    pairs = random_requests(args.num_prompts, in_lens, out_lens, TOKEN_IDS, seed)
    return [Request({"prompt": ids, "max_tokens": n, "temperature": 0.0, "ignore_eos": True},
                    "/v1/completions", ids, n) for ids, n in pairs]


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
    launch_args: list[str], warm_reqs: list[Request], reqs: list[Request], runs: int = 1,
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
        SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r.output_len)
        for r in reqs
    ]
    warm = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4)
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
    ap.add_argument("--rates", default="1,2,4,inf", help="requests/s, comma-separated; inf")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--range-ratio", type=float, default=0.0)
    ap.add_argument(
        "--client-procs",
        type=int,
        default=1,
        help="client processes (when one client core cannot keep up with the server)",
    )
    ap.add_argument("--offline", type=int, nargs="?", const=1, default=0, metavar="RUNS",
                    help="then LLM.generate on the same prompts, RUNS times (default 1; needs "
                    "--launch): a shared host's speed varies by run")
    ap.add_argument("--out", type=Path, default=Path("serve_bench.json"),
                    help="the figures as JSON (and the plot beside it, as .png)")
    args = ap.parse_args()
    if args.offline and args.launch is None:
        ap.error("--offline needs --launch, so that both runs use the same engine arguments")
    return args


def main() -> None:
    args = parse_args()
    rates = [math.inf if r.strip() in ("inf", "Inf") else float(r) for r in args.rates.split(",")]
    # distinct prompts (same length distribution) for the warm-up and for each rate, so no
    # run is served from the prefix cache another run filled; offline gets the inf rate's
    warm_reqs = make_requests(args, SEED)
    rate_reqs = [make_requests(args, SEED + 1 + i) for i in range(len(rates))]
    reqs = rate_reqs[rates.index(math.inf)] if math.inf in rates else rate_reqs[-1]
    launch_args = shlex.split(args.launch) if args.launch is not None else None
    proc, base_url = None, args.base_url.rstrip("/")
    if launch_args is not None:
        log = Path(tempfile.mkstemp(prefix="nanovllm-serve-", suffix=".log")[1])
        proc, base_url = launch(launch_args, log, LAUNCH_TIMEOUT_S)
    try:
        key = os.environ.get("NANOVLLM_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        models = httpx.get(base_url + "/v1/models", headers=headers, timeout=30).json()
        model = models["data"][0]["id"]
        print(f"server {base_url}, model {model}, {len(reqs)} prompts", flush=True)
        asyncio.run(warm_up(base_url, model, warm_reqs))
        runs = []
        for rate, rate_set in zip(rates, rate_reqs):
            before = process_cpu(proc.pid, log) if proc is not None else {}
            counters = engine_counters(base_url, headers)
            runs.append(run_rate(args.client_procs, base_url, model, rate_set, rate))
            print_table(runs[-1:])
            if before:
                report_server_cpu(before, process_cpu(proc.pid, log), runs[-1])
            report_steps(counters, engine_counters(base_url, headers), runs[-1])
    finally:
        if proc is not None:
            stop(proc)
    offline = None
    if args.offline:
        offline = run_offline(launch_args, warm_reqs, reqs, args.offline)
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
    title = f"{model}, {args.input_len}->{args.output_len}, {len(reqs)} prompts"
    plot(runs, args.out.with_suffix(".png"), title, offline)


if __name__ == "__main__":
    main()
