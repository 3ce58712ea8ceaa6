"""Paged attention on CUDA: the Triton kernels against the torch reference and SDPA.

    python -m benchmarks.attention            # main table, then tile / split sweeps
    python -m benchmarks.attention --quick    # main table only
    python -m benchmarks.attention --fp8      # bf16 against fp8 caches (V transposed as the
                                              # engine stores it, and in rows), fp8 tile sweep
    python -m benchmarks.attention --ragged   # ragged decode against the copy bandwidth
    python -m benchmarks.attention --prefill  # prefill tiles on a seed prefill step, 8 x 512
                                              # (with --fp8: over the engine's fp8 cache)
    python -m benchmarks.attention --fp8-decode  # the experimental fp8 decode (wgmma e4m3)
                                                 # against the engine's, bf16 for scale
    python -m benchmarks.attention --decode-buffers  # both caches' decode, K/V tiles double-
                                                     # and triple-buffered against the defaults
    python -m benchmarks.attention --fp8-registers  # the engine's fp8 decode under register
                                                    # caps (programs an SM), bf16 for scale
    python -m benchmarks.attention --kv-layouts  # decode over position- and head-major blocks
    python -m benchmarks.attention --group-rows  # decode dots over 16 rows or the GQA group's
    python -m benchmarks.attention --skip-past  # the fp8 decode's last tiles read to the end
    python -m benchmarks.attention --fp8-splits  # the fp8 decode's splits at small batches
    python -m benchmarks.attention --fresh  # prefill rows reading their own positions from
                                            # the step's K/V, both caches, against the cache
    (--fp8-registers, --decode-buffers, --kv-layouts, --group-rows, --skip-past, --fp8-splits:
    benchmarks/decode_tiles.py)

Shapes are Qwen3-0.6B's attention (16 query heads, 8 KV heads, head_dim 128, bf16).
Times are `triton.testing.do_bench` medians (L2 flushed before each run); "graph" is the
same call replayed from a CUDA graph (no launch overhead). GB/s counts the K/V bytes each
row's context must read once (sum of context lengths x Hkv x D x 2 tensors x 2 bytes);
TFLOP/s counts the causal score and value products (4 x Hq x D per visible (q, k) pair).
Every Triton result is checked against the fp32 torch reference; a failing case prints its
error and the run goes on; the exit status is 1 if any case failed.
"""

import argparse
import functools
import sys
import traceback

import torch

HQ, HKV, D = 16, 8, 128
DTYPE = torch.bfloat16
TOL = 2e-2  # worst per-token relative error vs the fp32 reference, bf16 inputs
FP8_MMA_TOL = 0.1  # fp8_attention: q (and P) in e4m3 move a token by 4-8% (its unit tests
# hold the kernels to those numerics, torch_attention.fp8_decode_reference)


class Batch:
    """Rows of (query_len, context_len) over a shuffled paged cache of random K/V."""

    def __init__(self, rows: list[tuple[int, int]], block_size: int, seed: int = 0,
                 kv: str = "bf16") -> None:
        from nanovllm.kernels import torch_attention as ta
        from nanovllm.kernels.attention_metadata import AttentionMetadata

        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.rows, self.block_size = rows, block_size
        qlens = [q for q, _ in rows]
        clens = [c for _, c in rows]
        needed = [-(-c // block_size) for c in clens]
        num_blocks = sum(needed)
        perm = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32)
        tables = torch.zeros(len(rows), max(needed), dtype=torch.int32, device="cuda")
        used = 0
        for i, n in enumerate(needed):
            tables[i, :n] = perm[used : used + n]
            used += n
        shape = (num_blocks, block_size, HKV, D)
        self.k_cache = torch.randn(shape, device="cuda", generator=gen, dtype=DTYPE)
        self.v_cache = torch.randn(shape, device="cuda", generator=gen, dtype=DTYPE)
        self.q = torch.randn(sum(qlens), HQ, D, device="cuda", generator=gen, dtype=DTYPE)
        starts = [0]
        for n in qlens:
            starts.append(starts[-1] + n)
        self.meta = AttentionMetadata(
            slot_mapping=torch.full((sum(qlens),), -1, dtype=torch.int64, device="cuda"),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device="cuda"),
            context_lens=torch.tensor(clens, dtype=torch.int32, device="cuda"),
            block_tables=tables,
            max_query_len=max(qlens),
            max_context_len=max(clens),
            query_lens_host=qlens,
            context_lens_host=clens,
        )
        self.scale = D**-0.5
        self.kv_bytes = sum(clens) * HKV * D * 2 * DTYPE.itemsize
        if kv.startswith("fp8"):  # "fp8-token" / "fp8-tensor": the bytes of worker/kv_cache.py
            width = ta.fp8_width(D, kv.startswith("fp8-token"))
            self.k_cache, self.v_cache = (
                ta.quantize_fp8(c.view(-1, HKV, D), width).view(*shape[:3], width)
                for c in (self.k_cache, self.v_cache))
            self.kv_bytes = sum(clens) * HKV * width * 2
            if not kv.endswith("-rows"):  # V stored transposed in each block, as the engine's
                self.v_cache = (self.v_cache.permute(0, 2, 3, 1).contiguous()
                                .permute(0, 3, 1, 2))
        # head-major blocks, a head's positions together: "-heads", or an fp8 K as the engine
        # stores it (kv_cache.FP8_K_HEAD_MAJOR) unless "-kpos" (position-major) or "-rows"
        from nanovllm.worker import kv_cache

        engine_k = (kv.startswith("fp8") and kv_cache.FP8_K_HEAD_MAJOR
                    and not kv.endswith(("-kpos", "-rows")))
        if kv.endswith("-heads") or engine_k:
            self.k_cache = self.k_cache.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
            if kv == "bf16-heads":  # (an fp8 V is head-major already: transposed per head)
                self.v_cache = self.v_cache.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
        # K's scales in a plane: "-plane", or "fp8-token" as the engine stores it
        # (kv_cache.FP8_K_SCALE_PLANE); "-kpad": head-major rows padded to 144 bytes
        if kv == "fp8-token-plane" or (kv == "fp8-token" and kv_cache.FP8_K_SCALE_PLANE):
            logical = self.k_cache
            self.k_cache = ta.scale_plane_view(torch.zeros_like(logical), D)
            values, scales = ta.scale_plane_parts(self.k_cache)
            values.copy_(logical[..., :D])
            scales.copy_(logical[..., D:D + 4])
        pairs = sum(sum(range(c - q + 1, c + 1)) for q, c in rows)
        self.flops = 4 * HQ * D * pairs
        self._expected = None

    def fresh(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's K/V as the engine would pass them with kernels.FRESH_PREFILL: each
        query token's own position's values (the cache's, dequantized), [T, Hkv, D] bf16."""
        from nanovllm.kernels import torch_attention as torch_backend

        blocks = torch.arange(self.k_cache.shape[0], device=self.k_cache.device)
        bs = self.block_size
        tables = self.meta.block_tables.long()
        slots = torch.cat([tables[i, pos // bs] * bs + pos % bs for i, (q, c) in
                           enumerate(self.rows)
                           for pos in [torch.arange(c - q, c, device=tables.device)]])
        return tuple(
            (torch_backend.dequantize_fp8(torch_backend._blocks(c, blocks), D, DTYPE)
             if c.dtype == torch.uint8 else c).reshape(-1, HKV, D)[slots].contiguous()
            for c in (self.k_cache, self.v_cache))

    def expected(self) -> torch.Tensor:
        from nanovllm.kernels import torch_attention as torch_backend

        if self._expected is None:
            blocks = torch.arange(self.k_cache.shape[0], device=self.k_cache.device)
            kc, vc = (torch_backend.dequantize_fp8(torch_backend._blocks(c, blocks), D,
                                                   torch.float32)
                      if c.dtype == torch.uint8 else c.float()
                      for c in (self.k_cache, self.v_cache))
            q = self.q.float()
            self._expected = torch_backend.paged_attention(q, kc, vc, self.meta, self.scale)
        return self._expected


def rel_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    if not torch.isfinite(out.float()).all():
        return float("inf")
    diff = (out.float() - expected).flatten(1).norm(dim=1)
    return (diff / expected.flatten(1).norm(dim=1).clamp_min(1e-6)).max().item()


class Table:
    def __init__(self) -> None:
        self.failures: list[str] = []
        print(f"{'case':44s} {'impl':28s} {'ms':>9s} {'graph ms':>9s} {'GB/s':>8s} "
              f"{'TFLOP/s':>8s} {'rel err':>9s}")

    def row(self, case: str, impl: str, ms: float, graph_ms: float | None, kv_bytes: int,
            flops: int, err: float | None, tol: float = TOL) -> None:
        best = min(ms, graph_ms) if graph_ms else ms
        gbs = kv_bytes / best / 1e6
        tflops = flops / best / 1e9
        g = f"{graph_ms:9.4f}" if graph_ms else f"{'-':>9s}"
        e = f"{err:9.1e}" if err is not None else f"{'-':>9s}"
        bad = "  <-- WRONG" if err is not None and not err < tol else ""
        if bad:
            self.failures.append(f"{case} / {impl}: rel err {err}")
        print(f"{case:44s} {impl:28s} {ms:9.4f} {g} {gbs:8.0f} {tflops:8.1f} {e}{bad}",
              flush=True)

    def error(self, case: str, impl: str, exc: BaseException) -> None:
        self.failures.append(f"{case} / {impl}: {exc!r}")
        print(f"{case:44s} {impl:28s} FAILED: {exc!r}", flush=True)
        traceback.print_exc(limit=4)


def bench(fn) -> float:
    import triton.testing

    ms = triton.testing.do_bench(fn, return_mode="median")
    return ms[0] if isinstance(ms, (list, tuple)) else ms


def bench_graph(fn) -> float | None:
    import triton.testing

    try:
        ms = triton.testing.do_bench_cudagraph(fn, return_mode="median")
    except Exception:  # a capture problem is reported by the graph test, not here
        return None
    return ms[0] if isinstance(ms, (list, tuple)) else ms


def run_triton(table: Table, case: str, impl: str, batch: Batch, graph: bool = False, **kw):
    from nanovllm.kernels import triton_attention as triton_backend

    fn = lambda: triton_backend.paged_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale, **kw
    )
    try:
        err = rel_error(fn(), batch.expected())
        ms = bench(fn)
        graph_ms = bench_graph(fn) if graph else None
        tol = FP8_MMA_TOL if kw.get("fp8_attention", "off") != "off" else TOL
        table.row(case, impl, ms, graph_ms, batch.kv_bytes, batch.flops, err, tol)
        return min(ms, graph_ms) if graph_ms else ms
    except Exception as exc:
        table.error(case, impl, exc)
        return None


def run_reference(table: Table, case: str, batch: Batch) -> None:
    from nanovllm.kernels import torch_attention as torch_backend

    fn = lambda: torch_backend.paged_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale
    )
    try:
        table.row(case, "torch reference", bench(fn), None, batch.kv_bytes, batch.flops, None)
    except Exception as exc:
        table.error(case, "torch reference", exc)


def run_sdpa(table: Table, case: str, num_rows: int, seq_len: int) -> None:
    """Causal SDPA over the same amount of contiguous [B, H, L, D] data (no paging)."""
    import torch.nn.functional as F

    q = torch.randn(num_rows, HQ, seq_len, D, device="cuda", dtype=DTYPE)
    k = torch.randn(num_rows, HKV, seq_len, D, device="cuda", dtype=DTYPE)
    v = torch.randn_like(k)
    kv_bytes = 2 * k.numel() * k.element_size()
    flops = 4 * HQ * D * num_rows * seq_len * (seq_len + 1) // 2
    try:
        fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        fn()
        impl = "sdpa (enable_gqa)"
    except TypeError:  # older torch: expand the KV heads up front, outside the timing
        k, v = (t.repeat_interleave(HQ // HKV, dim=1) for t in (k, v))
        fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
        impl = "sdpa (kv repeated)"
    try:
        table.row(case, impl, bench(fn), None, kv_bytes, flops, None)
    except Exception as exc:
        table.error(case, impl, exc)


def decode_rows(num_rows: int, lo: int, hi: int, seed: int = 0) -> list[tuple[int, int]]:
    gen = torch.Generator().manual_seed(seed)
    return [(1, int(c)) for c in torch.randint(lo, hi + 1, (num_rows,), generator=gen)]


def make_batch(table: Table, case: str, rows: list[tuple[int, int]], block_size: int,
               kv: str = "bf16"):
    try:
        return Batch(rows, block_size, kv=kv)
    except Exception as exc:
        table.error(case, "setup", exc)
        return None


def main_table(table: Table) -> None:
    from nanovllm.kernels import triton_decode as td

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for bs in (16, 256):
        case = f"decode B=256 ctx~1100 bs={bs}"
        if batch := make_batch(table, case, decode_rows(256, 1000, 1200), bs):
            run_triton(table, case, "triton", batch, graph=True)
            run_reference(table, case, batch)
        del batch

    for num_rows, ctx in ((1, 8192), (8, 8192), (32, 4096), (1, 1100)):
        case = f"decode B={num_rows} ctx={ctx} bs=16"
        if batch := make_batch(table, case, [(1, ctx)] * num_rows, 16):
            splits = td.choose_num_splits(num_rows, HKV, ctx, sms)
            run_triton(table, case, f"triton auto ({splits} splits)", batch, graph=True)
            run_triton(table, case, "triton 1 split", batch, graph=True, num_splits=1)
            run_reference(table, case, batch)

    for bs in (16, 256):
        case = f"prefill 8x512 bs={bs}"
        if batch := make_batch(table, case, [(512, 512)] * 8, bs):
            run_triton(table, case, "triton", batch)
            run_reference(table, case, batch)
    run_sdpa(table, "prefill 8x512 contiguous", 8, 512)

    case = "chunked prefill 8x512 over 1536 cached bs=16"
    if batch := make_batch(table, case, [(512, 2048)] * 8, 16):
        run_triton(table, case, "triton", batch)
        run_reference(table, case, batch)

    case = "mixed 1x512 prefill + 255 decode ~1100 bs=16"
    if batch := make_batch(table, case, [(512, 512)] + decode_rows(255, 1000, 1200), 16):
        run_triton(table, case, "triton", batch)
        run_reference(table, case, batch)


def sweeps(table: Table) -> None:
    """Tile and split choices around the defaults, to check (and retune) them on this GPU."""
    from nanovllm.kernels import triton_attention as tb
    from nanovllm.kernels import triton_decode as td
    from nanovllm.kernels import triton_prefill as tp

    print(f"\n-- decode tiles (default {td.default_decode_config(D, DTYPE)})")
    case = "decode tiles B=256 ctx~1100 bs=16"
    if batch := make_batch(table, case, decode_rows(256, 1000, 1200), 16):
        for block_n in (32, 64, 128):
            for num_warps in (4, 8):
                for num_stages in (2, 3):
                    cfg = tb.TileConfig(16, block_n, num_warps, num_stages)
                    run_triton(table, case, f"n{block_n} w{num_warps} s{num_stages}", batch,
                               decode_config=cfg)
    del batch

    decode_split_sweep(table)

    default = tp.default_prefill_config(D, 512, HQ // HKV, DTYPE)
    print(f"\n-- prefill tiles (default {default})")
    case = "prefill tiles 8x512 bs=16"
    if batch := make_batch(table, case, [(512, 512)] * 8, 16):
        for block_m in (64, 128):
            for block_n in (32, 64):
                for num_warps in (4, 8):
                    for num_stages in (2, 3):
                        cfg = tb.TileConfig(block_m, block_n, num_warps, num_stages)
                        impl = f"m{block_m} n{block_n} w{num_warps} s{num_stages}"
                        run_triton(table, case, impl, batch, prefill_config=cfg)


def seed_prefill_rows(tokens: int = 16384, seed: int = 0) -> list[tuple[int, int]]:
    """A first prefill step of the seed workload: fresh prompts of 100-1,024 tokens filling
    the GPU's default step of 16,384 tokens (the last one cut, as chunked prefill would)."""
    gen = torch.Generator().manual_seed(seed)
    rows, total = [], 0
    while total < tokens:
        n = min(int(torch.randint(100, 1025, (1,), generator=gen)), tokens - total)
        rows.append((n, n))
        total += n
    return rows


def prefill_sweep(table: Table, kv: str = "bf16") -> None:
    """Prefill tile choices around the default, on a seed prefill step and on 8 x 512, with
    SDPA on contiguous 8 x 512 for scale; over the engine's cache for `kv` on a GPU (bf16:
    blocks of 16; fp8-token: blocks of 128, V transposed)."""
    from nanovllm.kernels import triton_attention as tb
    from nanovllm.kernels import triton_prefill as tp
    from nanovllm.kernels.triton_tiles import FP8_MMA_TILE

    rows = seed_prefill_rows()
    bs = 16 if kv == "bf16" else 128
    for case, batch_rows in ((f"prefill seed step {len(rows)} rows bs={bs} {kv}", rows),
                             (f"prefill 8x512 bs={bs} {kv}", [(512, 512)] * 8)):
        default = tp.default_prefill_config(D, max(q for q, _ in batch_rows), HQ // HKV, DTYPE,
                                            fp8=kv != "bf16")
        print(f"\n-- {case} (default {default})")
        if not (batch := make_batch(table, case, batch_rows, bs, kv)):
            continue
        run_triton(table, case, "default", batch)
        # over an fp8 cache stages 2-4 give each K/V tile one buffer, 5 two (sm90_ptx)
        stage_set = (2, 3, 4) if kv == "bf16" else (2, 3, 4, 5)
        for block_m in (64, 128):
            for block_n in (32, 64, 128):
                for num_warps in (4, 8):
                    for num_stages in stage_set:
                        cfg = tb.TileConfig(block_m, block_n, num_warps, num_stages)
                        impl = f"m{block_m} n{block_n} w{num_warps} s{num_stages}"
                        run_triton(table, case, impl, batch, prefill_config=cfg)
        if kv != "bf16":  # fp8_attention's prefill: tiles of FP8_MMA_TILE positions, q in e4m3
            for mode in ("qp", "q"):  # (and P): its tiles spill at 128 rows (sm90_ptx)
                run_triton(table, case, f"fp8_attention={mode} default", batch,
                           fp8_attention=mode)
                for block_m in (64, 128):
                    for num_warps in (4, 8):
                        for num_stages in (2, 3):
                            cfg = tb.TileConfig(block_m, FP8_MMA_TILE, num_warps, num_stages)
                            impl = f"fp8_attention={mode} m{block_m} w{num_warps} s{num_stages}"
                            run_triton(table, case, impl, batch, prefill_config=cfg,
                                       fp8_attention=mode)
        del batch
    run_sdpa(table, "prefill 8x512 contiguous", 8, 512)


def fresh_table(table: Table) -> None:
    """The prefill over each cache reading the rows' own positions from this step's K/V
    (paged_attention's `fresh`, kernels.FRESH_PREFILL) against reading the cache, at the
    engine's tiles and a few others: a seed prefill step, 8 x 512, and 8 chunks of 512
    after 1,536 cached positions (blocks of 16 for bf16, 128 for fp8, as the engine's)."""
    from nanovllm.kernels import triton_attention as tb

    for kv in ("bf16", "fp8-token"):
        bs = 16 if kv == "bf16" else 128
        for case, rows in ((f"seed prefill step {kv}", seed_prefill_rows()),
                           (f"prefill 8x512 {kv}", [(512, 512)] * 8),
                           (f"chunk 8x512 after 1536 {kv}", [(512, 2048)] * 8)):
            print(f"\n-- {case}")
            if not (batch := make_batch(table, case, rows, bs, kv)):
                continue
            fresh = batch.fresh()
            run_triton(table, case, "cache (default)", batch)
            run_triton(table, case, "fresh (default tiles)", batch, fresh=fresh)
            for block_m, block_n, warps, stages in ((64, 64, 4, 3), (128, 32, 8, 3),
                                                    (128, 64, 8, 3), (128, 32, 8, 2),
                                                    (64, 32, 4, 3), (128, 64, 8, 2)):
                cfg = tb.TileConfig(block_m, block_n, warps, stages)
                run_triton(table, case, f"fresh m{block_m} n{block_n} w{warps} s{stages}",
                           batch, fresh=fresh, prefill_config=cfg)
            del batch, fresh


def fp8_table(table: Table, block_sizes: tuple[int, ...] = (256,), sweeps: bool = True) -> None:
    """The same batches over a bf16 cache and both fp8 formats (GB/s counts each format's own
    bytes, so equal GB/s means the fp8 run took about half the time), at each cache block
    size, then fp8 decode tiles."""
    from nanovllm.kernels import triton_attention as tb
    from nanovllm.kernels import triton_decode as td

    cases = [(f"{name} bs={bs}", rows, bs) for bs in block_sizes for name, rows in (
        ("decode B=256 ctx~1100", decode_rows(256, 1000, 1200)),
        ("decode B=256 ragged ctx 100-2000", decode_rows(256, 100, 2000)),
        ("decode B=32 ctx=4096", [(1, 4096)] * 32),
        ("prefill 8x512", [(512, 512)] * 8),
        ("mixed 1x512 prefill + 255 decode ~1100", [(512, 512)] + decode_rows(255, 1000, 1200)))]
    for case, rows, bs in cases:
        # "-rows": V in rows of positions, as before the engine stored an fp8 V transposed
        for kv in ("bf16", "fp8-token", "fp8-tensor", "fp8-token-rows", "fp8-tensor-rows"):
            if batch := make_batch(table, f"{case} {kv}", rows, bs, kv):
                run_triton(table, f"{case} {kv}", "triton", batch,
                           graph=rows[0][0] == 1)
            del batch
    if not sweeps:
        return
    print("\n-- fp8 decode splits (* = choose_num_splits), ragged 100-2000")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    auto = td.choose_num_splits(256, HKV, 4096, sms)
    rows = decode_rows(256, 100, 2000)
    for kv in ("bf16", "fp8-token", "fp8-tensor"):
        if batch := make_batch(table, f"decode splits ragged {kv}", rows, 256, kv):
            for splits in sorted({1, 2, 4, 8, 16, auto}):
                for block_n in (64, 128):
                    run_triton(table, f"decode splits ragged {kv}",
                               f"{splits}{'*' if splits == auto else ''} n{block_n}", batch,
                               graph=True, num_splits=splits,
                               decode_config=tb.TileConfig(16, block_n, 4, 2))
        del batch
    print(f"\n-- fp8 decode tiles (default {td.default_decode_config(D, DTYPE)})")
    rows = decode_rows(256, 100, 2000)
    for kv in ("fp8-token", "fp8-tensor"):
        case = f"decode tiles ragged 100-2000 bs=256 {kv}"
        if batch := make_batch(table, case, rows, 256, kv):
            for block_n in (32, 64, 128):
                for num_warps in (4, 8):
                    for num_stages in (2, 3, 4):
                        cfg = tb.TileConfig(16, block_n, num_warps, num_stages)
                        run_triton(table, case, f"n{block_n} w{num_warps} s{num_stages}",
                                   batch, decode_config=cfg)
        del batch


def fp8_decode_table(table: Table) -> None:
    """kernels/triton_fp8_decode.py (positions as M, both dots on fp8 tensor cores; P in
    e4m3 or float16) against the engine's fp8 decode and the bf16 cache's, CUDA-graph times,
    on blocks of 128 (an fp8 cache's on a GPU). Its error against the fp32 attention over the
    same values is printed, not failed: quantizing q and P is the point (the tests bound
    it)."""
    from nanovllm.kernels import triton_fp8_decode as fd

    for name, rows in (("decode B=256 ctx~1100", decode_rows(256, 1000, 1200)),
                       ("decode B=256 ragged 100-2000", decode_rows(256, 100, 2000)),
                       ("decode seed contexts", seed_decode_rows(256)),
                       ("decode B=16 ragged 100-2000", decode_rows(16, 100, 2000))):
        case = f"{name} bs=128"
        if batch := make_batch(table, f"{case} bf16", rows, 128):
            run_triton(table, f"{case} bf16", "triton (engine)", batch, graph=True)
        del batch
        for kv in ("fp8-token", "fp8-tensor"):
            if not (batch := make_batch(table, f"{case} {kv}", rows, 128, kv)):
                continue
            run_triton(table, f"{case} {kv}", "triton (engine)", batch, graph=True)
            for fp8_p in (True, False):
                for warps, stages in ((4, 2), (4, 3), (8, 2), (8, 3)):
                    impl = f"wgmma P {'e4m3' if fp8_p else 'f16'} w{warps} s{stages}"
                    fn = functools.partial(fd.decode_fp8, batch.q, batch.k_cache,
                                           batch.v_cache, batch.meta, batch.scale,
                                           fp8_p=fp8_p, num_warps=warps, num_stages=stages)
                    try:
                        err = rel_error(fn(), batch.expected())
                        table.row(f"{case} {kv}", impl, bench(fn), bench_graph(fn),
                                  batch.kv_bytes, batch.flops, None)
                        print(f"{'':44s} {'  error vs fp32 attention':28s} {err:9.1e}")
                    except Exception as exc:
                        table.error(f"{case} {kv}", impl, exc)
            del batch


def seed_decode_rows(num_rows: int, seed: int = 0) -> list[tuple[int, int]]:
    """Decode rows as the seed workload (bench.py) has them midway: prompts of 100-1,024
    tokens, outputs of 100-1,024, each row some way through its output."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(num_rows):
        prompt, output = (int(x) for x in torch.randint(100, 1025, (2,), generator=gen))
        rows.append((1, prompt + int(torch.randint(1, output + 1, (1,), generator=gen))))
    return rows


def ragged_table(table: Table) -> None:
    """Decode over ragged contexts against the device's copy bandwidth, measured in this run
    (issue 11's goal: >= 0.90 of it), in batch order and longest first, 1 and 2 splits."""
    from benchmarks.speed_of_light import _copy_seconds

    copy_bytes = 2 * 2**30
    copy_gbs = 2 * copy_bytes / _copy_seconds(copy_bytes, DTYPE, torch.device("cuda")) / 1e9
    print(f"copy bandwidth (2 GiB device to device, read + written): {copy_gbs:,.0f} GB/s")
    summary = []
    cases = [("decode B=256 seed contexts bs=256", seed_decode_rows(256)),
             ("decode B=256 ragged ctx 100-2000 bs=256", decode_rows(256, 100, 2000)),
             ("decode B=256 ctx~1100 bs=256", decode_rows(256, 1000, 1200))]
    for case, rows in cases:
        if batch := make_batch(table, case, rows, 256):
            for splits in (1, 2):
                for longest in (False, True):
                    impl = f"{splits} split{'s' * (splits > 1)} {'longest first' * longest}"
                    ms = run_triton(table, case, impl, batch, graph=True, num_splits=splits,
                                    longest_first=longest)
                    if ms:
                        summary.append((case, impl, batch.kv_bytes / ms / 1e6))
        del batch
    print(f"\n{'case':44s} {'impl':28s} {'GB/s':>8s} {'of copy':>8s}")
    for case, impl, gbs in summary:
        print(f"{case:44s} {impl:28s} {gbs:8.0f} {gbs / copy_gbs:8.3f}")


def decode_split_sweep(table: Table) -> None:
    from nanovllm.kernels import triton_decode as td

    print("\n-- decode splits (* = choose_num_splits)")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # ragged contexts, as in the offline workload's decode phase (graphs plan for 4096)
    for lo, hi in ((100, 1100), (100, 2000)):
        case = f"decode splits B=256 ragged ctx {lo}-{hi} bs=16"
        if batch := make_batch(table, case, decode_rows(256, lo, hi), 16):
            auto = td.choose_num_splits(256, HKV, 4096, sms)
            for splits in sorted({1, 2, 4, 8, auto}):
                run_triton(table, case, f"{splits}{'*' if splits == auto else ''}", batch,
                           graph=True, num_splits=splits)
        del batch
    for num_rows, ctx in ((1, 2048), (4, 8192), (16, 8192), (64, 4096), (256, 1100)):
        case = f"decode splits B={num_rows} ctx={ctx} bs=16"
        if batch := make_batch(table, case, [(1, ctx)] * num_rows, 16):
            auto = td.choose_num_splits(num_rows, HKV, ctx, sms)
            for splits in sorted({1, 2, 4, 8, 16, 32, auto}):
                run_triton(table, case, f"{splits}{'*' if splits == auto else ''}", batch,
                           graph=True, num_splits=splits)
        del batch


# one table instead of the main table and the sweeps; the first flag given, in this order,
# wins (--fp8 with --prefill: the prefill tiles over the engine's fp8 cache)
ONLY = (
    ("--splits", "only the decode split sweep"),
    ("--fp8", "only bf16 against fp8 caches, and the fp8 decode tile sweep"),
    ("--ragged", "only decode over ragged contexts against the copy bandwidth"),
    ("--prefill", "only the prefill tile sweep (a seed prefill step, 8 x 512)"),
    ("--fp8-decode", "only the experimental fp8 decode against the engine's"),
    ("--fp8-registers", "only the engine's fp8 decode under register caps"),
    ("--decode-buffers", "only both caches' decode at multi-buffered tiles"),
    ("--kv-layouts", "only both caches' decode over position- and head-major blocks"),
    ("--k-plane", "only the fp8 decode over K's padded rows against K's scales in a plane"),
    ("--group-rows", "only both caches' decode with dots of 16 rows against the group's"),
    ("--skip-past", "only the fp8 decode reading its last tiles to the end or whole"),
    ("--fp8-splits", "only the fp8 decode's split counts at small batches"),
    ("--fresh", "only the prefill reading each row's own positions from its K/V (fresh)"),
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="main table only, no sweeps")
    for flag, help_ in ONLY:
        parser.add_argument(flag, action="store_true", help=help_)
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[256],
                        help="--fp8: the cache block sizes of its table (the engine's is 16)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 0
    import triton

    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
          f"triton {triton.__version__}; Hq={HQ} Hkv={HKV} D={D} {DTYPE}\n")
    table = Table()
    fp8 = functools.partial(fp8_table, block_sizes=tuple(args.block_sizes), sweeps=not args.quick)
    fp8.__name__ = "fp8_table"
    if args.prefill and args.fp8:  # the prefill tiles over the engine's fp8 cache
        fp8 = functools.partial(prefill_sweep, kv="fp8-token")
        fp8.__name__ = "prefill_sweep"
    from benchmarks import decode_tiles as dt  # (it imports this module)

    tables = {"splits": decode_split_sweep, "fp8": fp8, "ragged": ragged_table,  # ONLY's
              "prefill": prefill_sweep, "fp8_decode": fp8_decode_table,  # flags, in order
              "fp8_registers": dt.fp8_register_table, "decode_buffers": dt.decode_buffers_table,
              "kv_layouts": dt.kv_layout_table, "k_plane": dt.k_plane_table,
              "group_rows": dt.group_rows_table,
              "skip_past": dt.skip_past_table, "fp8_splits": dt.fp8_split_table,
              "fresh": fresh_table}
    chosen = [fn for name, fn in tables.items() if getattr(args, name)]
    parts = chosen[:1] or (main_table, None if args.quick else sweeps)
    for part in parts:
        if part is None:
            continue
        try:
            part(table)
        except Exception as exc:  # keep going: the other part may still tell something
            table.error(part.__name__, "-", exc)
    if table.failures:
        print(f"\n{len(table.failures)} FAILED:")
        for f in table.failures:
            print("  " + f)
        return 1
    print("\nall cases correct")
    return 0


if __name__ == "__main__":
    sys.exit(main())
