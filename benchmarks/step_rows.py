"""Where the seed workload's time goes by batch size: its steps grouped by how many rows
they decode (and the steps with prompt tokens apart), with each group's wall time and the
host's parts of it (`wait` is the host idle on the device: a group with a large wait is
device-bound, one with little is host-bound).

    python -m benchmarks.step_rows [--model DIR] [--kv-cache-dtype fp8] [--num-seqs 256]

The engine is bench.py's as written, `LLM(path, enforce_eager=False, max_model_len=4096)`,
stepped by hand so each step is timed alone; the workload is benchmarks/offline.py's.
"""

import argparse
import time

from benchmarks.random_model import qwen3_random_model
from benchmarks.workloads import seed_workload

BUCKETS = [(1, 16), (16, 32), (32, 64), (64, 128), (128, 192), (192, 257), (257, 10**9)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="(default: random Qwen3-0.6B)")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--max-input-len", type=int, default=1024)
    ap.add_argument("--max-output-len", type=int, default=1024)
    args = ap.parse_args()
    from nanovllm import LLM, SamplingParams

    path = args.model or str(qwen3_random_model())
    llm = LLM(path, enforce_eager=False, max_model_len=4096, kv_cache_dtype=args.kv_cache_dtype)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    engine = llm.engine
    prompts, max_tokens = seed_workload(args.num_seqs, args.max_input_len, args.max_output_len)
    for prompt, n in zip(prompts, max_tokens):
        engine.add_request(prompt, SamplingParams(temperature=0.6, ignore_eos=True,
                                                  max_tokens=n))
    steps = []  # (decode rows, has prompt tokens, seconds, host seconds by part)
    start = time.perf_counter()
    while engine.scheduler.waiting or engine.scheduler.running:
        running = engine.scheduler.running
        prompt = bool(engine.scheduler.waiting) or any(s.in_prefill for s in running)
        before, t = dict(engine.timing), time.perf_counter()
        engine.step()
        parts = {k: v - before.get(k, 0.0) for k, v in engine.timing.items()}
        steps.append((len(running), prompt, time.perf_counter() - t, parts))
    wall = time.perf_counter() - start
    out = sum(max_tokens)
    print(f"{len(steps)} steps, {wall:.2f} s, {out / wall:,.0f} output tok/s "
          f"(kv cache {args.kv_cache_dtype})")
    names = ["wait", "launch", "schedule", "postprocess", "outputs"]
    print(f"{'rows':<12}{'steps':>6}{'wall s':>8}{'of run':>8}{'ms/step':>9}"
          + "".join(f"{n + ' ms':>15}" for n in names))
    groups = [("with prompts", [s for s in steps if s[1]])]
    groups += [(f"{lo}-{hi - 1}" if hi < 10**9 else f"{lo}+",
                [s for s in steps if not s[1] and lo <= s[0] < hi]) for lo, hi in BUCKETS]
    for name, group in groups:
        if not group:
            continue
        n, total = len(group), sum(s[2] for s in group)
        per = [sum(s[3].get(k, 0.0) for s in group) / n * 1e3 for k in names]
        print(f"{name:<12}{n:>6}{total:>8.2f}{total / wall:>8.1%}{total / n * 1e3:>9.2f}"
              + "".join(f"{p:>15.2f}" for p in per))


if __name__ == "__main__":
    main()
