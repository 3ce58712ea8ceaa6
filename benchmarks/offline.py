"""Offline throughput: the seed's workload, our engine against its speed of light and a peer.

    python -m benchmarks.offline                    # random-weight Qwen3-0.6B, ours + HF peer
    python -m benchmarks.offline --model DIR --out r.json
    python -m benchmarks.offline --no-peer          # bench.py as written (the defaults)
    python -m benchmarks.offline --no-peer --kv-cache-dtype fp8
    python -m benchmarks.offline --quick            # CPU smoke test: 8 seqs, 2-layer model

The workload (workloads.seed_workload) is nano-vllm's bench.py, draw for draw: random.seed(0);
256 prompts of randint(100, 1024) token ids in [0, 10000]; then max_tokens = randint(100, 1024)
each; temperature 0.6, ignore_eos, max_model_len 4096; one warm-up call; 133,966 output tokens.
Throughput = output tokens / wall time of the one timed `generate` call.

Without --model, the model is Qwen3-0.6B's shape (benchmarks/qwen3_0_6b_config.json) with
random weights, written once (random_model.QWEN3_RANDOM_DIR). The speed of light
(speed_of_light.py) is the workload's KV and weight bytes and FLOPs against the bandwidth and
matmul rate measured here at start-up. The peer (hf_peer.py) is transformers' continuous
batching with paged SDPA.

Each engine runs in its own child process, so each gets the whole GPU memory. The printed
report is offline_report.py's.
"""

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.offline_report import print_table
from benchmarks.random_model import QWEN3_RANDOM_DIR, build_random_model
from benchmarks.speed_of_light import ModelShape, measure_device, sol_times, workload_cost
from benchmarks.workloads import QWEN3_CONFIG, SEED_OUTPUT_TOKENS, seed_workload
from nanovllm.kernels.torch_attention import fp8_width

WARMUP_PROMPT = "Benchmark: "
PEER_TIMEOUT_S = 300.0  # the peer's timed run is stopped after this long
# --quick: Qwen3's layout and vocabulary, shrunk until a 2-core CPU runs it in seconds
QUICK_OVERRIDES = dict(
    num_hidden_layers=2,
    hidden_size=256,
    intermediate_size=768,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
)


def engine_device_dtype(cfg: dict) -> tuple[str, torch.dtype]:
    """Where and in what dtype our engine runs by default: the checkpoint's dtype on a GPU,
    float32 on a CPU (nanovllm.engine.resolve)."""
    if torch.cuda.is_available():
        name = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").replace("torch.", "")
        return "cuda", torch.bfloat16 if name == "float32" else getattr(torch, name)
    return "cpu", torch.float32


# ---- the two engines, each in a child process ------------------------------------------------


def run_ours(args: argparse.Namespace, prompts: list[list[int]], max_tokens: list[int]) -> dict:
    from nanovllm import LLM, SamplingParams

    opts = engine_options(args)
    t0 = time.perf_counter()
    llm = LLM(args.model, **opts)
    load_s = time.perf_counter() - t0
    llm.generate([WARMUP_PROMPT], SamplingParams(), use_tqdm=False)
    engine = llm.engine
    # the engine's counters are running totals: subtract the warm-up's share
    prefill0, decode0 = engine.num_prefill_tokens, engine.num_decode_tokens
    steps0 = engine.num_steps
    timing0 = dict(engine.timing)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in max_tokens]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    return {
        "engine_options": opts,
        "engine_config": dataclasses.asdict(engine.config),
        "dtype": engine.config.dtype,
        "kv_cache_tokens": engine.config.kv_cache_tokens,
        "load_s": load_s,
        "elapsed_s": elapsed,
        "output_tokens": tokens,
        "prompt_tokens": sum(len(p) for p in prompts),
        "wrong_length_requests": sum(len(o.token_ids) != m for o, m in zip(outs, max_tokens)),
        "throughput": tokens / elapsed,
        "prefill_tokens": engine.num_prefill_tokens - prefill0,
        "decode_tokens": engine.num_decode_tokens - decode0,
        "steps": engine.num_steps - steps0,
        # host seconds per part of the step loop; "wait" is the host idle on the GPU
        "step_timing_s": {k: v - timing0.get(k, 0.0) for k, v in engine.timing.items()},
    }


def engine_options(args: argparse.Namespace) -> dict:
    opts: dict = dict(max_model_len=4096)  # bench.py's one option; the rest the engine's
    if args.kv_cache_dtype is not None:
        opts["kv_cache_dtype"] = args.kv_cache_dtype
    return opts


def run_peer(args: argparse.Namespace, prompts: list[list[int]], max_tokens: list[int]) -> dict:
    from benchmarks.hf_peer import run_peer as hf_run

    cfg = json.loads((Path(args.model) / "config.json").read_text())
    device, dtype = engine_device_dtype(cfg)
    return hf_run(Path(args.model), prompts, max_tokens, device, dtype, PEER_TIMEOUT_S)


def run_child(kind: str, model_dir: Path, timeout: float | None) -> dict:
    """Run one engine in a fresh process (all the GPU memory to itself); its figures or an
    {"error": ...} dict, never an exception."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.offline",
            *sys.argv[1:],
            "--model",
            str(model_dir),
            "--worker",
            kind,
            "--worker-out",
            str(result),
        ]
        try:
            proc = subprocess.run(cmd, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"no result after {timeout:.0f} s (process killed)"}
        if result.is_file():
            return json.loads(result.read_text())
        return {"error": f"the {kind} process exited with status {proc.returncode}, no result"}


def worker_main(args: argparse.Namespace) -> None:
    prompts, max_tokens = seed_workload(args.num_seqs, args.max_input_len, args.max_output_len)
    try:
        fn = run_ours if args.worker == "ours" else run_peer
        out = fn(args, prompts, max_tokens)
    except Exception as e:  # the driver reports it and carries on with the other engine
        import traceback

        traceback.print_exc()
        out = {"error": f"{type(e).__name__}: {e}"}
    Path(args.worker_out).write_text(json.dumps(out, indent=2, default=str))


# ---- the driver --------------------------------------------------------------------------------


def prepare_model(args: argparse.Namespace) -> tuple[Path, dict, str]:
    if args.model:
        path = Path(args.model).expanduser()
        return path, json.loads((path / "config.json").read_text()), f"checkpoint {path}"
    cfg = json.loads(QWEN3_CONFIG.read_text())
    if args.quick:
        cfg.update(QUICK_OVERRIDES)
    t0 = time.perf_counter()
    path, built = build_random_model(cfg, Path(QWEN3_RANDOM_DIR + "-quick" * args.quick))
    how = f"built in {time.perf_counter() - t0:.1f} s" if built else "cached"
    name = "tiny Qwen3 (--quick)" if args.quick else "Qwen3-0.6B"
    return path, cfg, f"random-weight {name} at {path} ({how})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", help="a Hugging Face model directory (default: random Qwen3-0.6B)")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--no-peer", action="store_true", help="skip transformers' continuous batching")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default=None,
                    help="(default: the engine's, the model's dtype)")
    ap.add_argument("--out", help="write every figure to this JSON file")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="CPU smoke test: 8 seqs of 100-128 tokens, a 2-layer model",
    )
    ap.add_argument("--worker", choices=("ours", "peer"), help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.max_input_len = args.max_output_len = 128 if args.quick else 1024
    if args.quick:
        args.num_seqs = 8
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.worker:
        worker_main(args)
        return

    prompts, max_tokens = seed_workload(args.num_seqs, args.max_input_len, args.max_output_len)
    prompt_lens = [len(p) for p in prompts]
    seed_shape = (args.num_seqs, args.max_input_len, args.max_output_len) == (256, 1024, 1024)
    check = ""
    if seed_shape:
        ok = sum(max_tokens) == SEED_OUTPUT_TOKENS
        check = f" (seed's {SEED_OUTPUT_TOKENS:,}: {'ok' if ok else 'MISMATCH'})"
    print(
        f"workload: {args.num_seqs} seqs, {sum(prompt_lens):,} prompt tokens, "
        f"max_tokens sum {sum(max_tokens):,}{check}",
        flush=True,
    )

    model_dir, cfg, model_desc = prepare_model(args)
    print(f"model: {model_desc}", flush=True)
    device, dtype = engine_device_dtype(cfg)
    rates = measure_device(torch.device(device), dtype)
    shape = ModelShape.from_hf(cfg)
    dtype_bytes = torch.empty(0, dtype=dtype).element_size()
    # an fp8 cache (a scale per token-head, padded to 16 bytes) reads fewer bytes
    kv_bytes = (fp8_width(shape.head_dim) / shape.head_dim
                if args.kv_cache_dtype == "fp8" else None)
    cost = workload_cost(shape, prompt_lens, max_tokens, dtype_bytes, kv_bytes)
    sol = sol_times(cost, rates.bandwidth, rates.matmul_rate)
    total_out = sum(max_tokens)
    sol_tput = {k: total_out / sol[k] for k in ("serial", "per_phase", "overlap")}

    ours = run_child("ours", model_dir, None)
    peer = None if args.no_peer else run_child("peer", model_dir, PEER_TIMEOUT_S + 300)
    if peer and (peer.get("error") or peer.get("throughput") is None):
        why = peer.get("error") or f"timed out after {PEER_TIMEOUT_S:.0f} s"
        print(f"peer failed: {why}", flush=True)
    if ours.get("error"):
        print(f"ours failed: {ours['error']}", flush=True)

    report = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "argv": sys.argv[1:],
        "torch": torch.__version__,
        "workload": {
            "num_seqs": args.num_seqs,
            "max_input_len": args.max_input_len,
            "max_output_len": args.max_output_len,
            "temperature": 0.6,
            "ignore_eos": True,
            "max_model_len": 4096,
            "prompt_tokens": sum(prompt_lens),
            "output_tokens": total_out,
            "max_max_tokens": max(max_tokens),
        },
        "model": {
            "path": str(model_dir),
            "description": model_desc,
            "shape": dataclasses.asdict(shape),
            "matmul_params": shape.matmul_params,
            "dtype": str(dtype).replace("torch.", ""),
            "kv_bytes_per_token": shape.kv_bytes_per_token(dtype_bytes),
        },
        "device": rates.as_dict(),
        "speed_of_light": {
            "cost": dataclasses.asdict(cost),
            "times_s": sol,
            "throughput": sol_tput,
            "headline": "serial",
        },
        "ours": ours,
        "peer": peer,
    }
    for r in (ours, peer):
        if r and r.get("throughput"):
            r["fraction_of_sol"] = {k: r["throughput"] / v for k, v in sol_tput.items()}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    print_table(report, cost, sol, sol_tput, rates)

if __name__ == "__main__":
    main()
