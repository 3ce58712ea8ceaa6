"""The fp8 decode attention over the contexts an engine step has, by rows and context scale.

    python -m benchmarks.decode_contexts              # CUDA-graph medians, us and TB/s
    ncu --clock-control none --kernel-name regex:_decode_kernel --launch-skip 2 \\
        --launch-count 1 --set full python -m benchmarks.decode_contexts --once

Contexts as in profile_step.py's decode steps: prompts of 100-1,024 tokens, plus 21
(`--extra`) generated, times a scale (1.5: rows further into their outputs); one layer of
Qwen3-0.6B's attention over the engine's fp8 cache (blocks of 128, K's scales in a plane, V
transposed). TB/s counts the bytes the contexts hold: 132 of K and 132 of V a token-head.
`--once` launches the 256-row step-20 case three times and nothing else, for a profiler.
`--decode-stores`: per case, the layer's RoPE, K/V store and decode as the engine runs them
(the fused RoPE + store, then the decode) against kernels.DECODE_STORES (the RoPE, then the
decode storing each row's new K/V), and the decode alone, each in a CUDA graph that first
reads 256 MiB so the L2 holds none of the cache (that read's own graph subtracted), as an
engine step meets a layer's cache.
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
    ap.add_argument("--decode-stores", action="store_true",
                    help="the store before the decode against the decode storing (see above)")
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
        if args.decode_stores:
            print(f"{rows:4d} rows, contexts x{scale:.1f}: " + store_orders(batch), flush=True)
            continue

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


def store_orders(b) -> str:
    """The step's RoPE, store and decode of one layer both ways, L2 cold (see --decode-stores)."""
    import triton.testing

    from nanovllm.kernels import triton_attention as ta
    from nanovllm.kernels.triton_kv_store import qk_norm_rope_store
    from nanovllm.kernels.triton_ops import qk_norm_rope
    from nanovllm.model.layers.rotary import rope_inv_freq

    rows, hq, d = b.q.shape[0], b.q.shape[1], b.q.shape[2]
    hk = b.k_cache.shape[2]
    qkv = torch.randn(rows, (hq + 2 * hk) * d, device="cuda", dtype=torch.bfloat16)
    q, k, v = (x.view(rows, -1, d) for x in qkv.split([hq * d, hk * d, hk * d], dim=-1))
    ctx = b.meta.context_lens.long()
    positions = ctx - 1  # each row's new position: its context's last
    b.meta.slot_mapping = (b.meta.block_tables.gather(1, (positions // b.block_size)[:, None])
                           [:, 0].long() * b.block_size + positions % b.block_size)
    angles = torch.outer(torch.arange(4096, dtype=torch.float32), rope_inv_freq(d, 1e6, None))
    angles = angles.cuda()
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
    w = torch.ones(d, device="cuda", dtype=torch.bfloat16)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    meta, kc, vc = b.meta, b.k_cache, b.v_cache
    torch.cuda.synchronize()

    def store_first():
        qk_norm_rope_store(q, k, v, positions, cos, sin, kc, vc, meta.slot_mapping, w, w)
        ta.paged_attention(q, kc, vc, meta, b.scale)

    def decode_stores():
        qk_norm_rope(q, k, positions, cos, sin, w, w)
        ta.paged_attention(q, kc, vc, meta, b.scale, new_kv=(k, v))

    def decode_alone():
        ta.paged_attention(q, kc, vc, meta, b.scale)

    def cold(fn=None):
        def run():
            flush.max()
            if fn:
                fn()
        return triton.testing.do_bench_cudagraph(run, return_mode="median") * 1e3

    base = cold()
    a, s, n = (cold(fn) - base for fn in (store_first, decode_stores, decode_alone))
    return (f"RoPE + store, decode {a:6.1f} us; RoPE, decode storing {s:6.1f} us "
            f"({a / s:.3f}x); decode alone {n:6.1f} us")


def print_resources() -> None:
    """The compiled decode kernel's registers, spills and shared memory (what decides how
    many programs an SM holds)."""
    from nanovllm.kernels import triton_attention as ta

    for cache in getattr(ta._decode_kernel, "device_caches", {}).values():
        for compiled in cache[0].values():
            print(f"_decode_kernel: {compiled.n_regs} registers, {compiled.n_spills} spilled, "
                  f"{compiled.metadata.shared} B shared", flush=True)


if __name__ == "__main__":
    main()
