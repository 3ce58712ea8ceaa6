"""The fp8 decode attention over the contexts an engine step has, by rows and context scale.

    python -m benchmarks.decode_contexts              # CUDA-graph medians, us and TB/s
    ncu --clock-control none --kernel-name regex:_decode_kernel --launch-skip 2 \\
        --launch-count 1 --set full python -m benchmarks.decode_contexts --once

Contexts as in profile_step.py's decode steps: prompts of 100-1,024 tokens, plus 21
(`--extra`) generated, times a scale (1.5: rows further into their outputs); one layer of
Qwen3-0.6B's attention over the engine's fp8 cache (blocks of 128, K's scales in a plane, V
transposed). TB/s counts the bytes the contexts hold: 132 of K and 132 of V a token-head.
`--once` launches the 256-row step-20 case three times and nothing else, for a profiler.
The case of every row at 587 (the step-20 mean) tells raggedness from length: the decode
reads as fast there as over the step's ragged contexts, and faster at longer ones, whose
tiles are fuller (BENCHMARKS.md, fifteenth session).
"""

import argparse
import random

import torch

BYTES_A_TOKEN_HEAD = 2 * (128 + 4)
KV_HEADS = 8


def engine_contexts(rows: int, scale: float = 1.0, extra: int = 21, seed: int = 0) -> list:
    rnd = random.Random(seed)
    return [(1, int(rnd.randint(100, 1024) * scale) + extra) for _ in range(rows)]


def main() -> None:
    import triton.testing

    from benchmarks.attention import Batch
    from nanovllm.kernels import triton_attention as ta

    ap = argparse.ArgumentParser()
    ap.add_argument("--once", action="store_true", help="three launches for a profiler")
    ap.add_argument("--extra", type=int, default=21)
    ap.add_argument("--cases", type=int, default=5, help="the first N cases only")
    args = ap.parse_args()
    # (rows, scale); scale 0: every row the step-20 contexts' mean (587), nothing ragged
    cases = [(256, 1.0), (256, 0), (256, 1.5), (128, 1.5), (64, 1.7)][:args.cases]
    if args.once:
        cases = cases[:1]
    for rows, scale in cases:
        contexts = (engine_contexts(rows, scale, args.extra) if scale
                    else [(1, 587)] * rows)
        batch = Batch(contexts, 128, kv="fp8-token")
        torch.cuda.synchronize()  # the batch's set-up done before another stream reads it

        def decode(b=batch):
            return ta.paged_attention(b.q, b.k_cache, b.v_cache, b.meta, b.scale)

        if args.once:
            for _ in range(3):
                decode()
            torch.cuda.synchronize()
            return
        expected = batch.expected()
        err = ((decode().float() - expected).norm() / expected.norm()).item()
        ms = triton.testing.do_bench_cudagraph(decode, return_mode="median")
        tokens = sum(c for _, c in contexts)
        tbs = tokens * KV_HEADS * BYTES_A_TOKEN_HEAD / ms / 1e9
        print(f"{rows:4d} rows, contexts x{scale:.1f} (mean {tokens / rows:5.0f}): "
              f"{ms * 1e3:7.1f} us  {tbs:5.2f} TB/s  rel err {err:.1e}", flush=True)
    print_resources()


def print_resources() -> None:
    """The compiled decode kernel's registers, spills and shared memory (what decides how
    many programs an SM holds)."""
    from nanovllm.kernels import triton_decode as td

    for cache in getattr(td._decode_kernel, "device_caches", {}).values():
        for compiled in cache[0].values():
            print(f"_decode_kernel: {compiled.n_regs} registers, {compiled.n_spills} spilled, "
                  f"{compiled.metadata.shared} B shared", flush=True)


if __name__ == "__main__":
    main()
