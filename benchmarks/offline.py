"""Offline throughput: the seed's workload, our engine against its speed of light and a peer.

    python -m benchmarks.offline                    # random-weight Qwen3-0.6B, ours + HF peer
    python -m benchmarks.offline --model DIR --out r.json
    python -m benchmarks.offline --no-peer --enforce-eager
    python -m benchmarks.offline --no-peer --kv-cache-dtype fp8 [--fp8-attention qp]
    python -m benchmarks.offline --quick            # CPU smoke test: 8 seqs, 2-layer model

The workload (workloads.seed_workload) is nano-vllm's bench.py, draw for draw: random.seed(0);
256 prompts of randint(100, 1024) token ids in [0, 10000]; then max_tokens = randint(100, 1024)
each; temperature 0.6, ignore_eos, max_model_len 4096; one warm-up call; 133,966 output tokens.
Throughput = output tokens / wall time of the one timed `generate` call.

Without --model, the model is Qwen3-0.6B's shape (benchmarks/qwen3_0_6b_config.json) with
random weights, written once under --model-cache. The speed of light (speed_of_light.py) is
the workload's KV and weight bytes and FLOPs against the bandwidth and matmul rate measured here
at start-up. The peer (hf_peer.py) is transformers' continuous batching with paged SDPA.

Each engine runs in its own child process, so each gets the whole GPU memory. The printed
report is offline_report.py's.
"""

import argparse
import dataclasses
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.gpu_gaps import gpu_gaps
from benchmarks.host_waits import allocator_counts, malloc_watch, run_diagnostics, sync_watch
from benchmarks.offline_report import print_table
from benchmarks.random_model import QWEN3_RANDOM_DIR, build_random_model
from benchmarks.speed_of_light import ModelShape, measure_device, sol_times, workload_cost
from benchmarks.switches import add_switches, apply_switches
from benchmarks.workloads import QWEN3_CONFIG, SEED_OUTPUT_TOKENS, seed_workload
from nanovllm.kernels.torch_attention import fp8_width

WARMUP_PROMPT = "Benchmark: "
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
    set_engine_switches(args)
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
    alloc0 = allocator_counts()
    tracked = len(gc.get_objects())
    start = time.perf_counter()
    with (sync_watch(args.sync_debug) as syncs, malloc_watch(args.malloc_trace) as mallocs,
          run_diagnostics() as diagnostics, gpu_gaps(args.gpu_gaps, engine.runner) as gaps):
        outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    alloc = {k: v - alloc0[k] for k, v in allocator_counts().items()}
    tokens = sum(len(o.token_ids) for o in outs)
    result = {
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
        "allocator": alloc,  # during the timed run (allocator_counts)
        "syncs": dict(syncs.most_common(12)),  # --sync-debug
        "mallocs": dict(mallocs.most_common(12)),  # --malloc-trace
        "gpu_gaps": gaps,  # --gpu-gaps
        # the Triton variants the warm-up left, collections, CPU seconds and page faults
        **diagnostics,
    }
    result["gc"]["tracked_at_start"] = tracked
    # more timed runs in this process, optionally flipping overlap each time (an A/B on
    # one warm machine; the first run above stays the headline figure)
    repeats = []
    for _ in range(1, args.repeat):
        if args.alternate_overlap:
            engine.overlap = not engine.overlap
        assert engine.block_manager.reset_prefix_cache()  # the same prompts, no cache hits
        t_rep, timing_rep = time.perf_counter(), dict(engine.timing)
        with run_diagnostics() as diagnostics:
            rep = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t_rep
        repeats.append({
            "overlap": engine.overlap, "elapsed_s": dt,
            "throughput": sum(len(o.token_ids) for o in rep) / dt,
            "step_timing_s": {k: v - timing_rep[k] for k, v in engine.timing.items()},
            **diagnostics,
        })
    result["repeats"] = repeats
    return result


def set_decode_tile(spec: str, fp8: bool) -> None:
    """--decode-tile POSITIONS,WARPS,STAGES[,REGISTERS]: the decode kernel's tiles for this
    run's cache, in place of the engine's (triton_decode.DECODE_TILES)."""
    from nanovllm.kernels import triton_decode as td

    try:
        block_n, warps, stages, *cap = (int(x) for x in spec.split(","))
    except ValueError:
        raise SystemExit(f"--decode-tile {spec!r}: give POSITIONS,WARPS,STAGES[,REGISTERS], "
                         "e.g. 128,4,5,128") from None
    key = "fp8" if fp8 else "bf16"
    td.DECODE_TILES[key] = td.TileConfig(td.DECODE_TILES[key].block_m, block_n, warps, stages,
                                         max_registers=cap[0] if cap else None)


def set_engine_switches(args: argparse.Namespace) -> None:
    """The A/B flags that set module switches (benchmarks/switches.py) and the decode's
    tiles for this run's engine."""
    from nanovllm.kernels import triton_decode as td

    apply_switches(args)
    fp8 = args.kv_cache_dtype == "fp8"
    if args.decode_tile:
        set_decode_tile(args.decode_tile, fp8)
    if args.decode_group_rows:
        set_decode_group_rows(args.decode_group_rows, fp8)
    if args.decode_programs_per_sm:
        td.TARGET_PROGRAMS_PER_SM = args.decode_programs_per_sm


def set_decode_group_rows(rows: int, fp8: bool) -> None:
    """--decode-group-rows N: the decode's dots over max(N, the GQA group) rows instead of the
    group's only (TileConfig.block_m of this run's cache's tiles; 16 was the default)."""
    from nanovllm.kernels import triton_decode as td

    key = "fp8" if fp8 else "bf16"
    td.DECODE_TILES[key] = dataclasses.replace(td.DECODE_TILES[key], block_m=rows)


def engine_options(args: argparse.Namespace) -> dict:
    opts: dict = dict(max_model_len=4096)  # bench.py's one option; the rest the engine's
    for name in ("max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization",
                 "kv_cache_dtype", "fp8_attention"):
        if getattr(args, name) is not None:
            opts[name] = getattr(args, name)
    if args.block_size is not None:
        opts["block_size"] = args.block_size
    if args.enforce_eager:
        opts["enforce_eager"] = True
    if args.no_overlap:
        opts["overlap"] = False
    if args.mixed_graphs:
        opts["mixed_graphs"] = True
    if args.compile:
        opts["torch_compile"] = True
    if args.no_fused:
        opts["fused_kernels"] = False
    if args.no_split_k:
        opts["split_k"] = False
    return opts


def run_peer(args: argparse.Namespace, prompts: list[list[int]], max_tokens: list[int]) -> dict:
    from benchmarks.hf_peer import run_peer as hf_run

    cfg = json.loads((Path(args.model) / "config.json").read_text())
    device, dtype = engine_device_dtype(cfg)
    return hf_run(Path(args.model), prompts, max_tokens, device, dtype, args.peer_timeout)


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
    path, built = build_random_model(cfg, Path(args.model_cache))
    how = f"built in {time.perf_counter() - t0:.1f} s" if built else "cached"
    name = "tiny Qwen3 (--quick)" if args.quick else "Qwen3-0.6B"
    return path, cfg, f"random-weight {name} at {path} ({how})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", help="a Hugging Face model directory (default: random Qwen3-0.6B)")
    ap.add_argument(
        "--model-cache",
        help="where the random model is written once "
        "(default /tmp/nanovllm-qwen3-0.6b-random, with -quick for --quick)",
    )
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--max-input-len", type=int, default=1024)
    ap.add_argument("--max-output-len", type=int, default=1024)
    ap.add_argument("--no-peer", action="store_true", help="skip transformers' continuous batching")
    ap.add_argument(
        "--peer-timeout",
        type=float,
        default=300.0,
        help="seconds the peer's timed run may take before it is stopped",
    )
    ap.add_argument("--enforce-eager", action="store_true", help="engine option enforce_eager=True")
    ap.add_argument("--no-overlap", action="store_true", help="engine option overlap=False")
    ap.add_argument("--mixed-graphs", action="store_true",
                    help="engine option mixed_graphs=True")
    ap.add_argument("--compile", action="store_true", help="engine option torch_compile=True")
    ap.add_argument("--no-fused", action="store_true", help="engine option fused_kernels=False")
    ap.add_argument("--no-split-k", action="store_true", help="engine option split_k=False")
    ap.add_argument("--repeat", type=int, default=1, help="timed runs in one process")
    ap.add_argument("--alternate-overlap", action="store_true",
                    help="with --repeat: flip overlap before each further run (A/B)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None,
                    help="(default: the engine's)")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="(default: the engine's)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="(default: the engine's)")
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default=None,
                    help="(default: the engine's, the model's dtype)")
    ap.add_argument("--fp8-attention", choices=["off", "q", "qp"], default=None,
                    help="with --kv-cache-dtype fp8: decode on the fp8 tensor cores "
                    "(default: the engine's, off)")
    ap.add_argument("--decode-tile", metavar="N,W,S[,R]",
                    help="the decode kernel's tiles for this cache: positions, warps, stages "
                    "and a register cap (default: the engine's, triton_decode.DECODE_TILES)")
    ap.add_argument("--decode-group-rows", type=int, metavar="N",
                    help="the decode's dots over N rows (or the GQA group's, if more) "
                    "instead of the group's only (16: before 2026-12-01)")
    ap.add_argument("--decode-programs-per-sm", type=int, metavar="N",
                    help="the decode's KV splits aim at N programs an SM (default: the "
                    "engine's, triton_decode.TARGET_PROGRAMS_PER_SM)")
    add_switches(ap)
    ap.add_argument("--sync-debug", action="store_true",
                    help="a diagnostic run: list the lines where the first timed run made the "
                    "host wait for the GPU (torch's sync debug mode; slower)")
    ap.add_argument("--malloc-trace", action="store_true",
                    help="a diagnostic run: list where the first timed run's device mallocs "
                    "were made (torch's allocator history; slower)")
    ap.add_argument("--gpu-gaps", action="store_true",
                    help="a diagnostic run: the device's idle time between the first timed "
                    "run's steps, by kind of step (benchmarks/gpu_gaps.py)")
    ap.add_argument("--out", help="write every figure to this JSON file")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="CPU smoke test: 8 seqs of 100-128 tokens, a 2-layer model",
    )
    ap.add_argument("--worker", choices=("ours", "peer"), help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.num_seqs, args.max_input_len, args.max_output_len = 8, 128, 128
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.worker:
        worker_main(args)
        return
    if args.model_cache is None:
        args.model_cache = QWEN3_RANDOM_DIR + ("-quick" if args.quick else "")
    if args.no_overlap:
        engine_options(args)  # fail now, not after building the model

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
    kv_bytes = (fp8_width(shape.head_dim, True) / shape.head_dim
                if args.kv_cache_dtype == "fp8" else None)
    cost = workload_cost(shape, prompt_lens, max_tokens, dtype_bytes, kv_bytes)
    sol = sol_times(cost, rates.bandwidth, rates.matmul_rate)
    total_out = sum(max_tokens)
    sol_tput = {k: total_out / sol[k] for k in ("serial", "per_phase", "overlap")}

    ours = run_child("ours", model_dir, None)
    peer = None if args.no_peer else run_child("peer", model_dir, args.peer_timeout + 300)
    if peer and (peer.get("error") or peer.get("throughput") is None):
        why = peer.get("error") or f"timed out after {args.peer_timeout:.0f} s"
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
    for kind, row in (ours.get("gpu_gaps") or {}).items():
        print(f"gaps {kind:>17}: {row['steps']:5d} steps, device {row['device_s']:6.3f} s, "
              f"idle before {row['idle_before_s']:6.3f} s, host between launches "
              f"{row['host_between_launches_s']:6.3f} s", flush=True)


if __name__ == "__main__":
    main()
