"""A decode step's K/V store on CUDA, per cache format: where the fp8 store's time goes.

    python -m benchmarks.kv_store [--tokens 16 256 2048] [--block-size 128]
                                  [--pattern decode prefill] [--cold]

One layer of Qwen3-0.6B's shape (16 q heads, 8 KV heads of 128). `decode`: each token goes
to a slot of its own block, as a decode step's rows do; `prefill`: the tokens fill
consecutive slots, a prefill chunk's (--tokens 16384: a full prefill step of the GPU's
defaults). Per format, three launches: `store_kv` alone, the RoPE alone (`qk_norm_rope`, no
cache) and both fused (`qk_norm_rope_store`, the engine's path when a layer's ops and
attention are Triton's). Formats: the bf16 cache; fp8 with one scale (128 bytes a
token-head); fp8 with a float32 scale per token-head (144 bytes), V row-major; and the same
with V transposed within each block (the engine's fp8 cache, worker/kv_cache.py), whose V
bytes go one per row, `block_size` bytes apart. Times are `triton.testing.do_bench_cudagraph`
medians in microseconds (a graph of the launch replayed, so the host's launch cost is not in
them); "of write" is the time to write the bytes the format stores once at the device's copy
bandwidth (a lower bound a store could approach only with whole sectors).

--cold: `triton.testing.do_bench` medians instead, which overwrite the L2 cache before each
run. A replayed graph writes the same slots again, so their sectors sit in L2, where a
transposed V's one-byte writes merge; in the engine each step writes the next position of
every row, long evicted, and a sector written in part may cost the memory a read and a write
(the engine's fp8 decode step profiled 12.0 us a layer for RoPE + store at 256 rows against
8.3 here warm).
"""

import argparse
from functools import partial

import torch

from benchmarks.switches import add_switches, apply_switches
from nanovllm.kernels.torch_attention import fp8_width

FORMATS = ("bf16", "fp8 one scale", "fp8 token scales, V rows", "fp8 token scales, V_T")


def make_cache(fmt: str, num_blocks: int, block_size: int, heads: int, head_dim: int,
               dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache) views [blocks, block_size, heads, width], laid out as the engine
    lays them out for that format (worker/kv_cache.py)."""
    if fmt == "bf16":
        def one():
            return torch.zeros(num_blocks, block_size, heads, head_dim, dtype=torch.bfloat16,
                               device=dev)
        return one(), one()
    from nanovllm.kernels.torch_attention import scale_plane_view
    from nanovllm.worker.kv_cache import FP8_K_HEAD_MAJOR, FP8_K_SCALE_PLANE

    width = fp8_width(head_dim, scaled=fmt != "fp8 one scale")
    k = torch.zeros(num_blocks, block_size, heads, width, dtype=torch.uint8, device=dev)
    if fmt.endswith("V_T") and FP8_K_HEAD_MAJOR:  # the engine's K: head-major in each block,
        k = torch.zeros(num_blocks, heads, block_size, width, dtype=torch.uint8,
                        device=dev).permute(0, 2, 1, 3)
        if FP8_K_SCALE_PLANE:  # its scales in a plane after each block-head's values
            k = scale_plane_view(k, head_dim)
    if fmt.endswith("V_T") or fmt == "fp8 one scale":
        v = torch.zeros(num_blocks, heads, width, block_size, dtype=torch.uint8, device=dev)
        return k, v.permute(0, 3, 1, 2)
    return k, torch.zeros_like(k)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 256, 2048])
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--pattern", nargs="+", choices=["decode", "prefill"], default=["decode"])
    ap.add_argument("--q-heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--cold", action="store_true",
                    help="the L2 cache overwritten before each run (triton.testing.do_bench), "
                    "not a replayed graph")
    add_switches(ap, "--no-run-stores", "--v-with-k", "--no-run-heads", "--v-apart-all")
    args = ap.parse_args()
    import triton

    apply_switches(args)

    from benchmarks.speed_of_light import _copy_seconds
    from nanovllm.kernels.triton_kv_store import qk_norm_rope_store, store_kv
    from nanovllm.kernels.triton_ops import qk_norm_rope

    dev = torch.device("cuda")
    copy_bytes = 2 * 2**30
    copy_gbs = 2 * copy_bytes / _copy_seconds(copy_bytes, torch.bfloat16, dev) / 1e9
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {copy_gbs:,.0f} GB/s; "
          f"{args.q_heads} q heads, {args.kv_heads} KV heads of {args.head_dim}, "
          f"blocks of {args.block_size}; " + ("L2 cleared before each run" if args.cold
                                               else "CUDA-graph replays"))
    print(f"{'slots':<8} {'tokens':>6}  {'format':<26} {'store us':>9} {'rope us':>8} "
          f"{'fused us':>9} {'of write':>9}")
    d, hq, hk = args.head_dim, args.q_heads, args.kv_heads
    max_pos = 4096
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d))
    angles = torch.arange(max_pos, device=dev, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
    qw = torch.rand(d, device=dev, dtype=torch.bfloat16) + 0.5
    kw = torch.rand(d, device=dev, dtype=torch.bfloat16) + 0.5
    gen = torch.Generator(device="cpu").manual_seed(0)
    for pattern, tokens in [(p, t) for p in args.pattern for t in args.tokens]:
        qkv = torch.randn(tokens, (hq + 2 * hk) * d, device=dev, dtype=torch.bfloat16)
        q = qkv[:, : hq * d].view(tokens, hq, d)
        k = qkv[:, hq * d: (hq + hk) * d].view(tokens, hk, d)
        v = qkv[:, (hq + hk) * d:].view(tokens, hk, d)
        positions = torch.randint(0, max_pos, (tokens,), generator=gen).to(dev)
        if pattern == "decode":
            blocks = torch.randperm(tokens, generator=gen)
            offsets = torch.randint(0, args.block_size, (tokens,), generator=gen)
            slots = (blocks * args.block_size + offsets).to(dev)
        else:
            slots = torch.arange(tokens, device=dev)
        for fmt in FORMATS:
            k_cache, v_cache = make_cache(fmt, tokens, args.block_size, hk, d, dev)
            calls = (
                partial(store_kv, k, v, k_cache, v_cache, slots),
                partial(qk_norm_rope, q, k, positions, cos, sin, qw, kw),
                partial(qk_norm_rope_store, q, k, v, positions, cos, sin, k_cache, v_cache,
                        slots, qw, kw),
            )
            bench = triton.testing.do_bench if args.cold else triton.testing.do_bench_cudagraph
            store, rope, fused = (bench(c) * 1e3 for c in calls)
            written = 2 * tokens * hk * k_cache.shape[-1] * k_cache.element_size()
            floor = written / copy_gbs / 1e3
            print(f"{pattern:<8} {tokens:>6}  {fmt:<26} {store:>9.1f} {rope:>8.1f} "
                  f"{fused:>9.1f} {floor / fused:>9.2f}")


if __name__ == "__main__":
    main()
