"""The decode kernel's tile experiments on CUDA, run through benchmarks.attention's flags:
register caps (--fp8-registers), multi-buffered K/V tiles (--decode-buffers), head-major K
blocks (--kv-layouts), dots over the GQA group's heads only (--group-rows), the last tiles
read to the context's end (--skip-past). Each times the
engine's decode (CUDA-graph replays, checked against the fp32 reference) against its
variants, with benchmarks.attention's batches and table.

tests/model/sm90_ptx.py --decode-tiles compiles DECODE_BUFFER_CONFIGS for sm_90, so the
compile report and the timed sweep read one list.
"""

import dataclasses

from benchmarks.attention import (
    DTYPE,
    D,
    Table,
    decode_rows,
    make_batch,
    run_triton,
    seed_decode_rows,
)


def decode_tile_table(table: Table, configs: dict[str, list], row_sets) -> None:
    """Each cache's decode kernel at its engine tiles, then at `configs[cache]` ((positions,
    warps, stages, register cap) tuples; the engine's own tile is not timed twice), over
    each of `row_sets` ((name, rows) pairs): the bf16 cache in blocks of 16, the fp8 cache
    in blocks of 128 (an fp8 cache's on a GPU), CUDA-graph times."""
    from nanovllm.kernels import triton_attention as tb
    from nanovllm.kernels import triton_decode as td

    for name, rows in row_sets:
        for cache, block_size, kv in (("bf16", 16, "bf16"), ("fp8", 128, "fp8-token")):
            case = f"{name} bs={block_size} {cache}"
            if not (batch := make_batch(table, case, rows, block_size, kv)):
                continue
            engine = td.default_decode_config(D, DTYPE, fp8=cache == "fp8")
            run_triton(table, case, f"engine {engine}", batch, graph=True)
            for block_n, warps, stages, regs in configs[cache]:
                cfg = tb.TileConfig(16, block_n, warps, stages, max_registers=regs)
                if cfg != engine:
                    run_triton(table, case, f"n{block_n} w{warps} s{stages} regs {regs or '-'}",
                               batch, graph=True, decode_config=cfg)
            del batch


def kv_layout_table(table: Table) -> None:
    """Each cache's decode, CUDA-graph times, with position-major blocks ([block, position,
    head, width], a head's rows interleaved with the other heads'; a bf16 cache's, and an fp8
    K's before kv_cache.FP8_K_HEAD_MAJOR) against head-major blocks ([block, head, position,
    width]: one program's rows of a block contiguous), seed and ragged contexts."""
    for name, rows in (("decode seed contexts", seed_decode_rows(256)),
                       ("decode B=256 ragged 100-2000", decode_rows(256, 100, 2000)),
                       ("decode B=64 seed contexts", seed_decode_rows(64))):
        for block_size, kv in ((16, "bf16"), (16, "bf16-heads"), (128, "fp8-token-kpos"),
                               (128, "fp8-token-heads")):
            case = f"{name} bs={block_size} {kv}"
            if batch := make_batch(table, case, rows, block_size, kv):
                run_triton(table, case, "engine", batch, graph=True)
            del batch


def _layout_ab(table: Table, kvs: tuple[str, str]) -> None:
    # the fp8 decode (blocks of 128, the engine's tiles) over two cache layouts, alternating
    # twice, at the seed's contexts, ragged ones and 64 rows; CUDA-graph times, each checked
    # against the reference
    for name, rows in (("decode seed contexts", seed_decode_rows(256)),
                       ("decode B=256 ragged 100-2000", decode_rows(256, 100, 2000)),
                       ("decode B=64 seed contexts", seed_decode_rows(64))):
        batches = {kv: make_batch(table, f"{name} bs=128 {kv}", rows, 128, kv) for kv in kvs}
        if not all(batches.values()):
            continue
        for _ in range(2):
            for kv, batch in batches.items():
                run_triton(table, f"{name} bs=128 {kv}", "engine", batch, graph=True)
        del batches


def k_plane_table(table: Table) -> None:
    """The fp8 decode over K head-major with each row's scale after its values, padded to
    144 bytes, against K's scales in a plane after each block-head's values (the engine's,
    kv_cache.FP8_K_SCALE_PLANE: 132 bytes a position read instead of 144)."""
    _layout_ab(table, ("fp8-token-kpad", "fp8-token-plane"))


def skip_past_table(table: Table) -> None:
    """The fp8 decode (blocks of 128, the engine's tiles) reading nothing past each row's
    end (triton_decode.SKIP_PAST_END, the default) against reading its last tile whole,
    at the seed's contexts (as the engine sees them early and late in the run), ragged
    ones and 64 rows. CUDA-graph times; both checked against the reference."""
    from nanovllm.kernels import triton_decode as td

    for name, rows in (("decode seed contexts", seed_decode_rows(256)),
                       ("decode B=256 prompts 100-1024", decode_rows(256, 100, 1024)),
                       ("decode B=256 ragged 100-2000", decode_rows(256, 100, 2000)),
                       ("decode B=64 seed contexts", seed_decode_rows(64))):
        case = f"{name} bs=128 fp8-token"
        if not (batch := make_batch(table, case, rows, 128, "fp8-token")):
            continue
        for skip in (True, False, True, False):
            td.SKIP_PAST_END = skip
            run_triton(table, case, "skip past end" if skip else "whole last tile", batch,
                       graph=True)
        td.SKIP_PAST_END = True
        del batch


def fp8_split_table(table: Table) -> None:
    """The fp8 decode (blocks of 128, the engine's tiles) at the batches of the seed
    workload's last steps (16-128 rows, contexts 600-2,000) over 1-16 KV splits; * marks
    choose_num_splits' count as a CUDA graph planned for 4,096-token contexts gets it (the
    engine's). CUDA-graph times."""
    import torch

    from benchmarks.attention import HKV
    from nanovllm.kernels import triton_decode as td

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for num_rows in (16, 32, 64, 128):
        case = f"decode B={num_rows} ctx 600-2000 bs=128 fp8-token"
        if not (batch := make_batch(table, case, decode_rows(num_rows, 600, 2000), 128,
                                    "fp8-token")):
            continue
        auto = td.choose_num_splits(num_rows, HKV, 4096, sms)
        for splits in sorted({1, 2, 4, 8, 16, auto}):
            run_triton(table, case, f"{splits}{'*' if splits == auto else ''} splits", batch,
                       graph=True, num_splits=splits)
        del batch


# fp8 decode tiles at dots of the group's 2 rows, (positions, warps, stages, register cap),
# as Triton 3.9 compiles them for sm_90 (BENCHMARKS.md): 2 rows free registers and shared
# memory, so 64-position tiles fit 5 programs an SM without a cap or a spill
GROUP_ROWS_FP8_TILES = [
    (128, 4, 2, None),  # 122 registers, 34 KB: 4 programs (with the engine's cap of 128,
    # Triton 3.9 spilled 88 bytes and took 67 KB: 3 programs)
    (128, 4, 3, None),  # 124 registers, 34 KB: 4 programs
    (64, 4, 2, None),  # 95 registers, 17 KB: 5 programs
    (64, 4, 3, None),  # 92 registers, 17 KB: 5 programs
]


def group_rows_table(table: Table) -> None:
    """Each cache's decode at its engine tiles with the dots' rows at 16 (the default before
    2026-12-01) and at the GQA group's heads only (TileConfig.block_m; Qwen3-0.6B's group is
    2): compiled for sm_90, the fp8 decode then has ~15% fewer instructions (half the softmax's
    arithmetic, the HMMA count unchanged: Triton pads the dot), the bf16 one ~4%; then the
    fp8 decode at GROUP_ROWS_FP8_TILES with 2 rows. Over position-major and head-major K
    blocks (kv_cache.FP8_K_HEAD_MAJOR), as both may go together. CUDA-graph times."""
    from nanovllm.kernels import triton_attention as tb
    from nanovllm.kernels import triton_decode as td

    for name, rows in (("decode seed contexts", seed_decode_rows(256)),
                       ("decode B=256 ragged 100-2000", decode_rows(256, 100, 2000)),
                       ("decode B=64 seed contexts", seed_decode_rows(64))):
        for block_size, kv in ((16, "bf16"), (128, "fp8-token-kpos"), (128, "fp8-token-heads")):
            case = f"{name} bs={block_size} {kv}"
            if not (batch := make_batch(table, case, rows, block_size, kv)):
                continue
            engine = td.default_decode_config(D, DTYPE, fp8=kv.startswith("fp8"))
            for block_m in (16, 8, 2):
                cfg = dataclasses.replace(engine, block_m=block_m)
                run_triton(table, case, f"engine, dots of {block_m} rows", batch, graph=True,
                           decode_config=cfg)
            for block_n, warps, stages, regs in GROUP_ROWS_FP8_TILES if kv != "bf16" else ():
                cfg = tb.TileConfig(2, block_n, warps, stages, max_registers=regs)
                run_triton(table, case, f"2 rows n{block_n} w{warps} s{stages} regs {regs or '-'}",
                           batch, graph=True, decode_config=cfg)
            del batch


def fp8_register_table(table: Table) -> None:
    """The engine's fp8 decode at tiles and register caps (TileConfig.max_registers: at
    <= 128 registers a thread, 4 programs of 4 warps fit an SM's 64k registers, at the
    default ~147 only 3), on the seed's decode contexts and ragged ones; the bf16 cache's
    decode for scale."""
    configs = [(block_n, warps, stages, regs)
               for block_n, warps, stages in ((128, 4, 3), (128, 4, 2), (128, 8, 3), (64, 4, 3))
               for regs in (None, 128, 96)]
    decode_tile_table(table, {"bf16": [], "fp8": configs},
                      (("decode seed contexts", seed_decode_rows(256)),
                       ("decode B=256 ragged 100-2000", decode_rows(256, 100, 2000)),
                       ("decode B=64 seed contexts", seed_decode_rows(64))))


# Decode tiles whose K/V tiles Triton 3.6 double- or triple-buffers (compiled for sm_90
# on a CPU, `ttg.local_alloc` of 2-3 tiles): at the engine's stages (2 or 3) each tile has
# one buffer, and the next tile's cp.async is issued after the tile's dots (the loop's last
# instructions in the SASS), so every tile waits out a load's full latency. (block_n, warps,
# stages, register cap) -> its buffers, ptxas' registers and what fits an SM, by compile:
DECODE_BUFFER_CONFIGS = {
    "fp8": [
        (128, 4, 2, 128),  # the default: 1 buffer, 128 regs, 41 KB: 4 programs an SM
        (128, 4, 5, 128),  # 2 buffers, 75 KB: 3 programs
        (128, 4, 7, 128),  # 3 buffers, 108 KB: 2 programs
        (64, 4, 5, 128),  # 2 buffers of 64 positions, 110 regs, 39 KB: 4 programs
        (64, 4, 7, 128),  # 3 buffers, 108 regs, 56 KB: 4 programs
        (128, 8, 5, None),  # 2 buffers, 127 regs at 8 warps: 2 programs
        (64, 4, 5, 96),  # 2 buffers, 96 regs (48 bytes spilled): 5 programs
        (32, 4, 7, 96),  # 3 buffers of 32 positions, 88 regs, 30 KB: 5 programs
        (32, 4, 9, None),  # 4 buffers, 92 regs, 38 KB: 5 programs
    ],
    "bf16": [
        (64, 4, 3, None),  # the default: 1 buffer, 91 regs, 39 KB: 5 programs an SM
        (64, 4, 5, None),  # 2 buffers, 140 regs, 73 KB: 3 programs
        (32, 4, 5, None),  # 2 buffers of 32 positions, 72 regs, 38 KB: 5 programs
        (32, 4, 7, None),  # 3 buffers, 71 regs, 55 KB: 4 programs
    ],
}


def decode_buffers_table(table: Table) -> None:
    """Both caches' decode kernels at tiles that multi-buffer their K/V loads
    (DECODE_BUFFER_CONFIGS), against each cache's default, on the seed's decode contexts
    and ragged ones (256 rows)."""
    decode_tile_table(table, DECODE_BUFFER_CONFIGS,
                      (("decode seed contexts", seed_decode_rows(256)),
                       ("decode B=256 ragged 100-2000", decode_rows(256, 100, 2000))))
