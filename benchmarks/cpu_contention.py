"""The default model on a CPU that another process shares: torch's threads as the engine
adapts them (worker/cpu_threads.py) against a fixed count (torch's default, num_threads).

    python -m benchmarks.cpu_contention               # idle, then 1 busy core
    python -m benchmarks.cpu_contention --busy 0,1,2  # idle, 1 and 2 busy cores

For each number of busy cores, that many processes spin, each pinned to one of this
process's CPUs, while the engine decodes one stream (128 greedy tokens, EOS ignored) and
then 16 chat prompts at once; each engine runs in a fresh process, adaptive and fixed
alternating, best of --rounds. The spinning processes stand for whatever else a laptop is
doing.
"""

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import time

from benchmarks.workloads import CHAT_QUESTIONS


def measure(fixed: bool, max_tokens: int, out) -> None:
    """In a fresh process: single-stream and 16-prompt decode tok/s."""
    import torch

    from nanovllm import LLM, SamplingParams

    llm = LLM(num_threads=torch.get_num_threads()) if fixed else LLM()
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [llm.engine.render_chat([{"role": "user", "content": q}]) for q in CHAT_QUESTIONS]
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    figures = []
    for batch in (prompts[:1], prompts[:16]):
        start = time.perf_counter()
        outs = llm.generate(batch, sp, use_tqdm=False)
        figures.append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start))
    out.put((figures, torch.get_num_threads()))


def spinners(n: int) -> list[subprocess.Popen]:
    cpus = sorted(os.sched_getaffinity(0))
    code = ("import os, time; os.sched_setaffinity(0, {%d}); end = time.time() + 600\n"
            "while time.time() < end: pass")
    return [subprocess.Popen([sys.executable, "-c", code % cpus[i % len(cpus)]])
            for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--busy", default="0,1", help="busy cores to run under, comma-separated")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    print(f"{len(os.sched_getaffinity(0))} CPUs; decode tok/s, best of {args.rounds}")
    print(f"{'busy cores':>10} {'threads':>16} {'1 stream':>9} {'16 prompts':>11}")
    for busy in (int(b) for b in args.busy.split(",")):
        hogs = spinners(busy)
        try:
            time.sleep(0.5)
            best: dict[bool, list[float]] = {True: [0.0, 0.0], False: [0.0, 0.0]}
            ended: dict[bool, int] = {}
            for _ in range(args.rounds):
                for fixed in (False, True):
                    q = ctx.Queue()
                    p = ctx.Process(target=measure, args=(fixed, args.max_tokens, q))
                    p.start()
                    figures, threads = q.get()
                    p.join()
                    best[fixed] = [max(a, b) for a, b in zip(best[fixed], figures)]
                    ended[fixed] = threads
        finally:
            for h in hogs:
                h.kill()
                h.wait()
        for fixed in (True, False):
            name = (f"fixed {ended[fixed]}" if fixed else f"adaptive (->{ended[fixed]})")
            print(f"{busy:>10} {name:>16} {best[fixed][0]:>9.1f} {best[fixed][1]:>11.1f}")
        print(f"{'':>10} {'adaptive/fixed':>16} {best[False][0] / best[True][0]:>8.2f}x "
              f"{best[False][1] / best[True][1]:>10.2f}x")


if __name__ == "__main__":
    main()
