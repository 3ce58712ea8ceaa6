"""The decode step's projections by cuBLAS under this process's BLAS settings.

The four projections of a Qwen3-0.6B layer (qkv, o, gate_up, down; bf16, no bias) at the
row counts decode steps run, each timed as the engine meets it: one launch per layer over
28 layers' distinct weights inside a CUDA graph, so every launch reads its weights from
HBM (0.88 GB a step does not fit the L2). Prints microseconds a launch, and the launch's
share of its weights' read time at `--bandwidth` (TB/s).

The settings come from the environment, so compare them one process each, e.g.:

    python -m benchmarks.blas
    TORCH_BLAS_PREFER_CUBLASLT=1 python -m benchmarks.blas
    CUBLAS_WORKSPACE_CONFIG=:32768:2 python -m benchmarks.blas
    python -m benchmarks.blas --no-reduced-precision   (bf16 reductions in fp32 only)

`--chain`: instead, a layer's RMSNorm -> projection -> SiLU (the engine's Triton norm and SiLU,
under PDL) for qkv and gate_up, 28 layers in one graph, the projection by cuBLAS against
triton_linear.small_linear (SMALL_GEMMS), and with `--sweep` over its tiles: does a
projection that chains under PDL with its neighbours pay, and at which tiles?

`--triton`: also triton_linear's GEMM kernel unsplit (one program per output tile, the whole
contraction each) over a sweep of tiles, at qkv's and gate_up's shapes, each row count's
best against cuBLAS: is a tile cuBLAS misses worth a kernel of ours?
"""

import argparse

import torch

# (name, in features, out features) of Qwen3-0.6B's layer (hidden 1,024, 16 + 8 + 8 heads
# of 128, MLP 3,072)
SHAPES = (("qkv", 1024, 4096), ("o", 2048, 1024), ("gate_up", 1024, 6144), ("down", 3072, 1024))
LAYERS = 28


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64, 128, 256])
    ap.add_argument("--bandwidth", type=float, default=4.0, help="TB/s for the floor")
    ap.add_argument("--no-reduced-precision", action="store_true",
                    help="allow_bf16_reduced_precision_reduction off")
    ap.add_argument("--triton", action="store_true", help="and a sweep of Triton tiles")
    ap.add_argument("--chain", action="store_true",
                    help="norm -> qkv / gate_up -> SiLU chains, cuBLAS against small_linear")
    ap.add_argument("--sweep", action="store_true", help="with --chain: and a tile sweep")
    args = ap.parse_args()
    if args.chain:
        chains(args.rows, args.sweep)
        return
    if args.no_reduced_precision:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.manual_seed(0)
    dev = torch.device("cuda")
    print(f"preferred BLAS: {torch.backends.cuda.preferred_blas_library()}, bf16 reduced "
          f"precision: {torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction}")
    weights = {name: [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
                      for _ in range(LAYERS)] for name, k, n in SHAPES}
    line = f"{'rows':>5}" + "".join(f"{name:>18}" for name, _, _ in SHAPES) + f"{'sum':>10}"
    print(line + "   (us a launch, and its weights' read time at the bandwidth over it)")
    for rows in args.rows:
        cells, total = [], 0.0
        for name, k, n in SHAPES:
            x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
            us = linear_time(x, weights[name])
            floor = n * k * 2 / (args.bandwidth * 1e12) * 1e6
            cells.append(f"{us:9.2f} ({floor / us:4.2f})")
            total += us
        print(f"{rows:>5}" + "".join(f"{c:>18}" for c in cells) + f"{total:10.2f}", flush=True)
    if args.triton:
        triton_sweep(weights, args.rows, args.bandwidth)


def triton_sweep(weights: dict, row_counts, bandwidth: float) -> None:
    import itertools

    import triton

    for name, k, n in SHAPES[::2]:  # qkv, gate_up: the two cuBLAS runs in the engine
        ws = weights[name]
        for rows in row_counts:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            cublas = linear_time(x, ws)
            results = []
            for bm, bn, bk, stages in itertools.product((16, 64, 128), (32, 64, 128),
                                                         (64, 128), (3, 4)):
                if bm > max(16, triton.next_power_of_2(rows)):
                    continue
                tile = (bm, bn, bk, stages, 8 if bm == 128 else 4)
                try:
                    results.append((tile_time(x, ws, tile), tile))
                except Exception as e:  # out of shared memory, say
                    print(f"  {name} {rows} {tile}: {type(e).__name__}")
            results.sort()
            floor = n * k * 2 / (bandwidth * 1e12) * 1e6
            best = ", ".join(f"{us:.2f} {tile}" for us, tile in results[:3])
            print(f"{name:>8} {rows:>4} rows: cuBLAS {cublas:.2f} us ({floor / cublas:.2f}); "
                  f"Triton best {best} ({cublas / results[0][0]:.2f}x)", flush=True)


def chains(row_counts, sweep: bool, device: str = "cuda") -> None:
    import itertools

    import torch.nn.functional as F

    from nanovllm.kernels import triton_linear, triton_ops

    torch.manual_seed(0)
    dev = torch.device(device)
    weights = {name: [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
                      for _ in range(LAYERS)] for name, k, n in SHAPES[::2]}
    norm_w = torch.ones(1024, device=dev, dtype=torch.bfloat16)
    defaults = triton_linear.SMALL_TILES
    print("us a layer: RMSNorm (residual add) -> projection -> SiLU, the projection by cuBLAS "
          "and by small_linear (SMALL_GEMMS, at its default tiles)")
    for rows in row_counts:
        h = torch.randn(rows, 1024, device=dev, dtype=torch.bfloat16)
        res = torch.zeros(rows, 1024, device=dev, dtype=torch.bfloat16)
        # the default tile for these rows, or the last one's above them
        tiles = defaults if rows <= defaults[-1][0] else ((rows, defaults[-1][1]),)
        for name, _, _ in SHAPES[::2]:
            def run(proj, ws=weights[name], h=h, res=res):
                for w in ws:
                    x, _ = triton_ops.add_rms_norm(h, res, norm_w, 1e-6)
                    y = proj(x, w)
                    assert y is not None, "small_linear declined the shape"
                    triton_ops.silu_and_mul(y)

            def small(tiles=tiles):
                # above the engine's row limit (SMALL_TILES) as well
                switch = triton_linear.SMALL_GEMMS
                triton_linear.SMALL_GEMMS, triton_linear.SMALL_TILES = True, tiles
                try:
                    return graph_time(lambda: run(triton_linear.small_linear)) / LAYERS
                finally:
                    triton_linear.SMALL_GEMMS, triton_linear.SMALL_TILES = switch, defaults

            cublas = graph_time(lambda: run(F.linear)) / LAYERS
            triton = small()
            line = (f"{name:>8} {rows:>4} rows: cuBLAS {cublas:6.2f}, small_linear {triton:6.2f} "
                    f"({cublas / triton:.2f}x)")
            if sweep:  # small_linear's tiles at this row count
                bm = min(64, max(16, 1 << (rows - 1).bit_length()))
                swept = []
                for bn, bk, stages in itertools.product((16, 32, 64), (64, 128, 256), (3, 4)):
                    tile = (bm, bn, bk, stages)
                    try:
                        swept.append((small(((rows, tile),)), tile))
                    except Exception as e:  # out of shared memory, say
                        print(f"  {name} {rows} {tile}: {type(e).__name__}")
                swept.sort()
                line += "; best " + ", ".join(f"{us:.2f} {t}" for us, t in swept[:3])
            print(line, flush=True)


def linear_time(x: torch.Tensor, ws: list) -> float:
    """Microseconds a launch of x @ w^T by cuBLAS, one a weight of ws, in a graph."""
    return graph_time(lambda: [torch.nn.functional.linear(x, w) for w in ws]) / len(ws)


def tile_time(x: torch.Tensor, ws: list, tile: tuple) -> float:
    """The same by triton_linear's kernel unsplit at tile (block_m, block_n, block_k, stages,
    warps), into fp32."""
    import triton

    from nanovllm.kernels.triton_linear import _split_k_kernel

    bm, bn, bk, stages, warps = tile
    rows, k = x.shape
    n = ws[0].shape[0]
    out = torch.empty(1, rows, n, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(rows, bm), n // bn, 1)

    def run():
        for w in ws:
            _split_k_kernel[grid](x, w, out, rows, n, k, k, x.stride(0), w.stride(0),
                                  BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PRECISION="tf32",
                                  num_warps=warps, num_stages=stages)
    return graph_time(run) / len(ws)


def graph_time(fn, replays: int = 20) -> float:
    """Median microseconds of a CUDA-graph replay of fn (captured after a warm-up)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


if __name__ == "__main__":
    main()
