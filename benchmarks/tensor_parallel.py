"""Tensor parallelism: TP=N against TP=1 on the seed workload and at batch 1.

    python -m benchmarks.tensor_parallel                 # Qwen3-8B's shape, TP 1 and 2 (GPUs)
    python -m benchmarks.tensor_parallel --shape 0.6b --tp 1 2
    python -m benchmarks.tensor_parallel --quick         # CPU smoke test: tiny model, gloo

Each engine runs with its defaults (plus max_model_len 4096, as the seed's bench.py) in a
child process of its own, one after the other, on random bf16 weights written once:
- throughput: the seed workload (workloads.seed_workload: 256 prompts of 100-1024 tokens,
  100-1024 output tokens each, temperature 0.6, ignore_eos), output tokens / wall time of
  one timed `generate`, after one warm-up call;
- batch-1 latency: one 128-token prompt, 256 greedy output tokens; per-token latency is the
  time between the first and the last token over the tokens between them;
- agreement: greedy outputs of 8 prompts, compared with TP=1's (random bf16 weights give
  nearly flat distributions, so reduction order alone may flip a near tie).
The report prints each figure and TP=N's ratio to TP=1, side by side from one run.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.random_model import build_random_model, shape_config
from benchmarks.workloads import seed_workload

QUICK = dict(num_seqs=8, max_len=64)


def child(args: argparse.Namespace) -> dict:
    from nanovllm import LLM, SamplingParams

    quick = args.quick
    opts = dict(max_model_len=4096 if not quick else 512, tensor_parallel_size=args.child)
    if quick:
        opts.update(device="cpu", num_kv_blocks=512)
    start = time.perf_counter()
    llm = LLM(args.model, **opts)
    load_s = time.perf_counter() - start
    llm.generate(["Benchmark: "], SamplingParams(max_tokens=16), use_tqdm=False)
    n, length = (QUICK["num_seqs"], QUICK["max_len"]) if quick else (256, 1024)
    prompts, max_tokens = seed_workload(n, length, length)
    vocab = engine_vocab = llm.engine.model_config.vocab_size
    prompts = [[t % vocab for t in p] for p in prompts] if engine_vocab < 10001 else prompts
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in max_tokens]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    # batch 1: step the engine by hand to time each token
    engine = llm.engine
    out_len = 32 if quick else 256
    engine.add_request(prompts[0][:128],
                       SamplingParams(temperature=0, ignore_eos=True, max_tokens=out_len),
                       request_id="latency", stream=True)
    stamps = []
    seen = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if len(out.token_ids) > seen:
                seen = len(out.token_ids)
                stamps.append(time.perf_counter())
    per_token = (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)
    greedy = llm.generate(prompts[:8], SamplingParams(temperature=0, ignore_eos=True,
                                                      max_tokens=32), use_tqdm=False)
    result = {
        "tp": args.child, "load_s": load_s,
        "elapsed_s": elapsed, "output_tokens": tokens,
        "throughput": tokens / elapsed, "batch1_token_ms": per_token * 1e3,
        "batch1_tokens_timed": len(stamps), "engine": engine.config.summary(),
        "greedy": [o.token_ids for o in greedy],
    }
    llm.shutdown()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="8b", choices=["8b", "0.6b", "tiny"])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out", default=None, help="write the results as JSON")
    ap.add_argument("--quick", action="store_true", help="tiny model on the CPU")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        Path(args.result).write_text(json.dumps(child(args)))
        return
    shape = "tiny" if args.quick else args.shape
    cfg = shape_config(shape)
    model_dir = Path(tempfile.gettempdir()) / f"nanovllm-{shape}"
    model, _ = build_random_model(cfg, model_dir)
    results = []
    for tp in args.tp:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [sys.executable, "-m", "benchmarks.tensor_parallel", "--child", str(tp),
                   "--model", str(model), "--result", f.name]
            cmd += ["--quick"] if args.quick else []
            subprocess.run(cmd, check=True)
            results.append(json.loads(Path(f.name).read_text()))
    base = results[0]
    print(f"\nshape {shape}; {base['output_tokens']} output tokens per run")
    print(f"{'TP':>3} {'tok/s':>10} {'x TP1':>7} {'batch-1 ms/token':>17} "
          f"{'TP1 / this':>10} {'greedy = TP1':>13} {'load s':>7}")
    for r in results:
        same = sum(a == b for a, b in zip(r["greedy"], base["greedy"]))
        ratio = r["throughput"] / base["throughput"]
        faster = base["batch1_token_ms"] / r["batch1_token_ms"]
        print(f"{r['tp']:>3} {r['throughput']:>10,.0f} {ratio:>6.2f}x "
              f"{r['batch1_token_ms']:>17.2f} {faster:>9.2f}x "
              f"{same:>9}/{len(r['greedy'])} {r['load_s']:>7.1f}")
    for r in results:
        print(f"TP={r['tp']}: {r['engine']}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
