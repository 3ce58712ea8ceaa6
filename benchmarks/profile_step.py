"""Where a decode step's time goes on the GPU: kernel time by kind, host time by part,
and any host<->device synchronization inside the step loop.

    python -m benchmarks.profile_step [--model DIR] [--num-seqs 256]
                                      [--kv-cache-dtype fp8] [--prefill]
                                      (PROFILE_ROWS=30: more rows of the kernel table)

Runs --num-seqs requests of the offline workload's shape until prefill is over, then profiles
20 decode steps with torch.profiler and CUDA's sync debug mode. (Its draws are
bench.py's ranges taken request by request, prompt then max_tokens: not the offline
workload's requests, which draw all prompts first.) `--prefill` profiles the prefill steps
instead (the first ~9 steps of 16,384 tokens, after a warm-up request set of the same
shape has been served once).
"""

import argparse
import os
import random
import time
import warnings

import torch

from benchmarks.random_model import qwen3_random_model

STEPS = 20  # decode steps profiled


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="(default: the random-weight Qwen3-0.6B)")
    ap.add_argument("--num-seqs", type=int, default=256, help="rows in the profiled decode")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    ap.add_argument("--prefill", action="store_true", help="profile the prefill steps")
    args = ap.parse_args()

    from nanovllm import LLM, SamplingParams

    path = args.model or str(qwen3_random_model())
    llm = LLM(path, max_model_len=4096, max_num_seqs=512, max_num_batched_tokens=16384,
              kv_cache_dtype=args.kv_cache_dtype)
    engine = llm.engine
    random.seed(0)

    def add_requests(max_tokens=None):
        for _ in range(args.num_seqs):
            prompt = [random.randint(0, 10000) for _ in range(random.randint(100, 1024))]
            n = random.randint(100, 1024)
            engine.add_request(prompt, SamplingParams(temperature=0.6, ignore_eos=True,
                                                      max_tokens=max_tokens or n))

    def in_prefill():
        return engine.scheduler.waiting or any(s.in_prefill for s in engine.scheduler.running)

    if args.prefill:  # one set served to the end first: every kernel compiled and warm
        add_requests(max_tokens=2)
        while engine.has_unfinished_requests():
            engine.step()
    add_requests()
    if not args.prefill:
        while in_prefill():
            engine.step()
        for _ in range(20):
            engine.step()

    def run() -> int:
        if not args.prefill:
            for _ in range(STEPS):
                engine.step()
            return STEPS
        n = 0
        while in_prefill():
            engine.step()
            n += 1
        return n

    if not args.prefill:  # unprofiled first: host time by part, nothing but perf_counter
        torch.cuda.synchronize()
        t_before, start = dict(engine.timing), time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        print(f"unprofiled, {len(engine.scheduler.running)} rows: "
              f"{wall / STEPS * 1e3:.2f} ms/step")
        _print_host_parts(engine, t_before, STEPS)
    torch.cuda.synchronize()
    t0 = dict(engine.timing)
    start = time.perf_counter()
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as prof:
            steps = run()
            torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode(0)
    wall = time.perf_counter() - start
    rows = len(engine.scheduler.running)
    print(f"{steps} {'prefill' if args.prefill else 'decode'} steps, {rows} rows, "
          f"overlap={engine.overlap}: {wall / steps * 1e3:.2f} ms/step (profiled)")
    _print_host_parts(engine, t0, steps)
    kernel_us = sum(e.device_time_total for e in prof.key_averages()
                    if e.device_type == torch.autograd.DeviceType.CUDA)
    print(f"GPU kernel time {kernel_us / steps / 1e3:.2f} ms/step "
          f"({kernel_us / 1e6 / wall:.0%} of profiled wall time)")
    syncs = {}
    for w in caught:
        msg = str(w.message).splitlines()[0][:120]
        syncs[msg] = syncs.get(msg, 0) + 1
    print(f"synchronizing ops seen: {sum(syncs.values())}")
    for msg, n in sorted(syncs.items(), key=lambda kv: -kv[1])[:8]:
        print(f"  {n:5d}  {msg}")
    table = prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=int(os.environ.get("PROFILE_ROWS", 18)),
        max_name_column_width=60,
    )
    print(table)


def _print_host_parts(engine, timing_before: dict, steps: int) -> None:
    print("  host ms/step: " + ", ".join(
        f"{k} {(v - timing_before[k]) / steps * 1e3:.2f}" for k, v in engine.timing.items()))


if __name__ == "__main__":
    main()
