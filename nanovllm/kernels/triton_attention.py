"""Paged attention in Triton: the CUDA backend, same contract and results as `torch_attention`.

Two entry points:

- `store_kv` (triton_kv_store.py, re-exported here): one program per token copies its K/V
  into the paged cache (slot -1 skips), quantizing for an fp8 cache.
- `paged_attention`, three kernels:
  * rows with one query token (decode) go to `_decode_kernel`, one program per
    (row, kv head, split); the kv head's GQA query heads are the M dimension of `tl.dot`
    (padded to 16), so each K/V tile is read once per group. With num_splits > 1 each
    split covers a slice of the context and writes a partial (normalized acc, log2-sum-exp),
    and `_reduce_kernel` combines the splits (flash-decoding). With `longest_first` the
    grid is (kv head x split, row slot) and slot i runs the i-th longest row: the GPU
    starts programs in grid order, so no long row starts last and runs alone at the end.
  * rows with several query tokens (prefill, chunked prefill over a cached prefix) go to
    `_prefill_kernel`, one program per (tile of BLOCK_Q tokens of one row, kv head) with
    M = BLOCK_Q tokens x the group's query heads; the causal mask is applied only to the
    tiles that straddle the diagonal.

Launch grids depend only on tensor shapes and python ints, never on device values, so a
decode step can be captured in a CUDA graph. What is baked into a launch:
  decode:  num_rows (= context_lens.shape[0]), num kv/q heads, head_dim, block_size,
           dtype, block table width (its stride), num_splits (from num_rows and
           meta.max_context_len, or the `num_splits` argument), tile config;
  prefill: T (= q.shape[0]), num_rows, heads, head_dim, block_size, dtype, BLOCK_Q
           (from meta.max_query_len), tile config;
  the path itself: meta.max_query_len == 1 runs the decode kernel alone; otherwise the
           prefill kernel runs, plus the decode kernel if query_lens_host has a 1.
Everything else (query_start_loc, context_lens, block_tables, slot_mapping) is read on
the device, so replaying a captured decode graph with new values of those is correct as long
as every context fits the captured block table width. Any num_splits is correct for any
context lengths: splits past a row's context are empty and weigh nothing in the reduction.

Padding rows (context_len 0, query_len 0 or 1, slot -1) produce zeros in their own output
row, or nothing if their query_len is 0, never NaN, and touch no cache slot.

An fp8 cache: K rows of e4m3 bytes (with each token-head's scale) and V stored transposed
within each block (worker/kv_cache.py), so that both tiles reach the tensor cores from one
trip through shared memory, as bytes, converted to float16 in registers
(`_load_block_tile`); a row-major V (blocks of under 16 tokens) takes
`_load_kv_tile`'s PTX conversion.

`fp8_attention` (q, and P, in e4m3 on the fp8 tensor cores): prefill rows take the prefill
kernel's `FP8_MMA` path (`_softmax_step_fp8`), decode rows triton_fp8_decode.py's kernel,
which builds on this module's decode pieces (`_decode_program`, `_decode_span`,
`_decode_out`, `split_partials`, `reduce_splits`).

Why one file of ~800 lines: the decode and prefill kernels share the tile loaders and the
online-softmax step (`_load_kv_tile`, `_online_softmax`), and the launch contract above binds
all of them; apart, each would restate it.
"""

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanovllm.kernels.attention_metadata import AttentionMetadata
from nanovllm.kernels.triton_e4m3 import _rows_to_e4m3, _to_e4m3

# the backend's other entry point, and the cache-format flags both files launch with
from nanovllm.kernels.triton_kv_store import _fp8_flags, store_kv  # noqa: F401
from nanovllm.kernels.triton_pdl import pdl_enter, pdl_launch

LOG2E = 1.4426950408889634
# _NO_RESPECIALIZE: Triton compiles a variant per integer argument that is 1 or divisible by
# 16; arguments that change from step to step (row and split counts) are kept generic, so
# a step of a new size never compiles a kernel in the middle of serving
# a finite "minus infinity" for running maxima, so a row that has seen no key yet gives
# exp2(m_old - m_new) = 1 instead of exp2(-inf + inf) = NaN
NEG_BIG = tl.constexpr(-1.0e30)

# split-KV heuristic (see `choose_num_splits`)
TARGET_PROGRAMS_PER_SM = 4  # bf16 d128 decode programs fit ~5 per SM (regs and smem)
MIN_SPLIT_TOKENS = 256  # fewer tokens per split and the partial write + reduce dominate
MAX_SPLITS = 64
# decode programs of the longest contexts start first (paged_attention's `longest_first`):
# on the H200 the seed's ragged decode contexts read at 1.01 of copy bandwidth with it, 0.88
# without, and the seed workload runs 1.05x faster (BENCHMARKS.md)
LONGEST_FIRST = True
# an fp8 cache's decode tiles (whole in one block) read nothing past the context's end: K
# row by row, V 16 positions at a time. Off, they read the whole tile, on average half of the
# last one past the end. (Prefill tiles read whole: masked, Triton loaded their V scales a
# byte at a time, and prefill is bound by its dots, not its reads.)
SKIP_PAST_END = True
# the longest-first order ranked by one launch of B small programs (_rank_kernel); off,
# torch's argsort (a radix sort of several launches, 18 us a step at 256 rows on the H200)
RANK_KERNEL = True
RANK_BLOCK = 128  # rows a _rank_kernel program compares at a time
PREFILL_BLOCK_N, PREFILL_STAGES = 32, 3  # a bf16 cache's prefill tiles (default_prefill_config)
FP8_PREFILL_STAGES = 3  # an fp8 cache's (64 x 64 tiles at 4 warps)
FP8_DECODE_REGISTERS = 128  # an fp8 cache's decode: 4 programs of 4 warps an SM
# fp8_attention's tiles, prefill and decode: its numerics round P against each tile's running
# maximum, so both kernels and torch_attention.fp8_decode_reference share the tile
FP8_MMA_TILE = 128


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes and launch options of one kernel (tests shrink them; benchmarks sweep)."""

    # prefill: query rows per program (tokens x padded GQA group); decode: the fewest rows
    # of its dots (the GQA group's heads padded to a power of 2, at least block_m; Triton pads
    # a dot under the tensor cores' 16 rows itself, but the softmax then works on the real
    # rows only: benchmarks/attention.py --group-rows)
    block_m: int
    block_n: int  # KV positions per tile; any multiple or fraction of the cache block size
    num_warps: int = 4
    num_stages: int = 2
    # ptxas' register cap a thread (None: its own choice): fewer registers fit more programs
    # on an SM; applied on a GPU only (the interpreter has no registers)
    max_registers: int | None = None


def default_prefill_config(
    head_dim: int, max_query_len: int, group: int, dtype: torch.dtype = torch.bfloat16,
    fp8: bool = False,
) -> TileConfig:
    # Sized on sm_90 to compile without register spills (`python -m tests.model.sm90_ptx`
    # reports ptxas' registers and spills): bf16 d128 at ~150 regs; the fp8 cache's tiles at
    # the 255 cap (no spill with the device's Triton 3.6). fp32 is the exact test path; its
    # "ieee" dot runs on FMAs, so small tiles.
    # A bf16 cache's KV tiles are 32 positions (3 stages at 8 warps): on the H200 a seed
    # prefill step (27 fresh prompts, 16,384 tokens) took 0.243 ms against 0.306 with 64
    # and 2, 8 x 512 0.062 against 0.071 (benchmarks/attention.py --prefill). An fp8
    # cache's are 64 query rows by 64 positions at 4 warps and 3 stages: 0.366 ms against
    # 0.411 with 128 rows at 8 warps, 8 x 512 0.083 against 0.091 (--prefill --fp8).
    exact = dtype == torch.float32
    cap = 32 if exact else 64 if fp8 or head_dim > 128 else 128
    # a tile holds at least one token of every query head of the group; beyond that, short
    # queries get a short tile so chunks of a few tokens do not pay for 128 mostly-empty rows
    block_m = max(16, _pow2(group), min(cap, _pow2(max_query_len * _pow2(group))))
    if exact:
        return TileConfig(block_m, block_n=16, num_warps=8, num_stages=2)
    if head_dim > 128:
        return TileConfig(block_m, block_n=32, num_warps=4, num_stages=2)
    if fp8:
        return TileConfig(block_m, block_n=64, num_warps=4, num_stages=FP8_PREFILL_STAGES)
    wide = block_m >= 128
    return TileConfig(block_m, block_n=PREFILL_BLOCK_N, num_warps=8 if wide else 4,
                      num_stages=PREFILL_STAGES if wide else 2)


def default_decode_config(head_dim: int, dtype: torch.dtype = torch.bfloat16,
                          fp8: bool = False) -> TileConfig:
    """`fp8`: the cache holds fp8 bytes, so a tile of 128 positions moves a bf16 tile of
    64's bytes (on the H200 the seed workload ran 1.12x faster with them; fp8 V tiles stay
    within one block, hence the 128-token blocks of an fp8 cache, engine/resolve.py)."""
    if dtype == torch.float32:
        return TileConfig(block_m=16, block_n=32, num_warps=8, num_stages=2)
    if head_dim <= 128:
        return DECODE_TILES["fp8" if fp8 else "bf16"]
    return TileConfig(block_m=16, block_n=32, num_warps=4, num_stages=2)


# The decode's tiles for head_dim <= 128, by cache (benchmarks/offline.py --decode-tile puts
# another in for an A/B). fp8: ptxas gave it ~147 registers a thread, so 3 programs an SM;
# capped at 128 (a few bytes spilled), 4 fit: on the H200 the seed's decode contexts read
# 1.04x faster, ragged ones 1.06x (benchmarks/attention.py --fp8-registers). bf16 d128: ~91
# registers, 39 KB of shared memory, so 5 programs fit an SM. At these stages each K/V tile
# has one buffer (`python -m tests.model.sm90_ptx --decode-tiles`; BENCHMARKS.md).
# block_m=1: the dots span the GQA group's heads only (padded to a power of 2; Triton pads
# them to the tensor cores' 16 rows), not 16 rows of which the softmax works on 14 padding
# rows: the H200's fp8 decode 1.03-1.04x, the seed workload 1.05x; bf16 decode 1.01x
# (benchmarks/attention.py --group-rows, BENCHMARKS.md)
DECODE_TILES = {
    "fp8": TileConfig(block_m=1, block_n=128, num_warps=4, num_stages=2,
                      max_registers=FP8_DECODE_REGISTERS),
    "bf16": TileConfig(block_m=1, block_n=64, num_warps=4, num_stages=3),
}


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # interpreter runs: pretend an H100/H200 so the split logic is exercised


def choose_num_splits(
    num_rows: int, num_kv_heads: int, max_context_len: int, num_sms: int = 132
) -> int:
    """KV splits per (row, kv head) for decode: enough programs to fill the GPU, but each
    split keeps >= MIN_SPLIT_TOKENS of context so its partial write and the reduce stay cheap.

    Depends only on python ints, so a CUDA graph captured with a given (num_rows,
    max_context_len) replays the same grid; pass the max context the graph will serve.
    """
    programs = num_rows * num_kv_heads
    if programs <= 0 or max_context_len <= MIN_SPLIT_TOKENS:
        return 1
    wanted = triton.cdiv(TARGET_PROGRAMS_PER_SM * num_sms, programs)
    useful = triton.cdiv(max_context_len, MIN_SPLIT_TOKENS)
    return max(1, min(wanted, useful, MAX_SPLITS))


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs would silently use tf32 tensor cores; the fp32 path is the exact one
    return "ieee" if dtype == torch.float32 else "tf32"


# ---------------------------------------------------------------------------------------
# shared tile step of the online softmax


@triton.jit
def _load_kv_tile(
    cache_ptr, bt_row_ptr, pos, valid, kv_head, offs_d,
    stride_b, stride_s, stride_h, stride_d,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr, TRANSPOSED: tl.constexpr,
    FP8: tl.constexpr = False, SCALED: tl.constexpr = False, COMPUTE: tl.constexpr = None,
    FP8_ASM: tl.constexpr = False,
):
    # -> (tile, scale). FP8: the tile's e4m3 values come back as COMPUTE (the query's dtype),
    # unscaled; when SCALED, `scale` holds each position's float32 scale, which the caller
    # applies to the scores (K) and the probabilities (V): [G, N] multiplies instead of
    # [N, D], and the fp8 -> bf16 conversion feeds the dot directly. Otherwise `scale` is
    # unused (and compiled away).
    # each position looks up its own block, so a tile may span part of a block or several
    if MASKED:
        blk = tl.load(bt_row_ptr + pos // BLOCK_SIZE, mask=valid, other=0)
    else:
        blk = tl.load(bt_row_ptr + pos // BLOCK_SIZE)
    base = blk.to(tl.int64) * stride_b + (pos % BLOCK_SIZE) * stride_s + kv_head * stride_h
    # an fp8 tile is loaded [N, D] (contiguous), converted, then transposed: loading bytes
    # [D, N] made the compiler shuffle single bytes through shared memory
    if TRANSPOSED and not FP8:  # [D, N], the right operand of q @ k^T
        ptrs = cache_ptr + base[None, :] + offs_d[:, None] * stride_d
        pos_ok = valid[None, :]
        dim_ok = offs_d[:, None] < HEAD_DIM
    else:  # [N, D]
        ptrs = cache_ptr + base[:, None] + offs_d[None, :] * stride_d
        pos_ok = valid[:, None]
        dim_ok = offs_d[None, :] < HEAD_DIM
    # masks only where needed: a full tile of a power-of-2 head_dim loads unmasked
    other = 0.0
    if MASKED:
        if HEAD_DIM == BLOCK_D:
            mask = pos_ok
        else:
            mask = pos_ok & dim_ok
    else:
        if HEAD_DIM == BLOCK_D:
            mask = None
            other = None
        else:
            mask = dim_ok
    # one return at the end: compiled Triton does not take an early return in a constexpr if
    if FP8:
        if MASKED or HEAD_DIM != BLOCK_D:
            raw = tl.load(ptrs, mask=mask, other=0)
        else:
            raw = tl.load(ptrs)
        if FP8_ASM:
            # e4m3 -> float16 in registers, 4 bytes at a time, by the instruction Triton's own
            # cast uses; as an opaque (not pure) asm, Triton cannot move the conversion past
            # the tile's trip through shared memory. With the cast, it did: the tile crossed
            # as bytes, and V (contracted over positions, which are not contiguous) was
            # gathered a byte per load (64 ld.shared.b8 a tile) instead of by ldmatrix.
            # The dots then run in float16 (exact for e4m3; the query is clamped to it).
            tile = tl.inline_asm_elementwise(
                asm="{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
                    "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
                constraints="=r,=r,r", args=[raw], dtype=tl.float16, is_pure=False, pack=4)
        else:  # the interpreter, and float32 queries
            tile = raw.to(tl.float8e4nv, bitcast=True).to(COMPUTE)
        if TRANSPOSED:
            tile = tl.trans(tile)
    else:
        tile = tl.load(ptrs, mask=mask, other=other)
    if SCALED:
        scale_ptr = (cache_ptr + base + HEAD_DIM * stride_d).to(tl.pointer_type(tl.float32))
        if MASKED:
            scale = tl.load(scale_ptr, mask=valid, other=0.0)
        else:
            scale = tl.load(scale_ptr)
    else:
        scale = pos.to(tl.float32)
    return tile, scale


@triton.jit
def _tile_block(cache_ptr, bt_row_ptr, start, kv_head, stride_b, stride_s, stride_h,
                BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    # where the tile of positions start .. start + BLOCK_N - 1 begins in its one block
    # (BLOCK_N divides BLOCK_SIZE, start a multiple of BLOCK_N): a single table entry
    blk = tl.load(bt_row_ptr + start // BLOCK_SIZE)
    # said outright: a loop's induction variable carries no divisibility for the compiler
    first = tl.multiple_of(start % BLOCK_SIZE, BLOCK_N)
    return cache_ptr + blk.to(tl.int64) * stride_b + kv_head * stride_h + first * stride_s


@triton.jit
def _load_masked(ptrs, read, MASKED: tl.constexpr):
    # MASKED: only where `read` (0 elsewhere: a scale not read weighs its position nothing)
    if MASKED:
        x = tl.load(ptrs, mask=read, other=0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _load_block_tile(
    cache_ptr, bt_row_ptr, start, offs_n, valid, end, kv_head, offs_d,
    stride_b, stride_s, stride_h, stride_d,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,
    SCALED: tl.constexpr, COMPUTE: tl.constexpr, V_T: tl.constexpr, SKIP: tl.constexpr,
    K_PLANE: tl.constexpr = False,
):
    # -> (tile in COMPUTE, scale [N]) of an fp8 cache whose tile of positions
    # start .. start + N - 1 lies in one block: K^T [D, N] from K's rows of positions, or,
    # V_T, V [N, D] from a V cache stored transposed within each block (worker/kv_cache.py),
    # a head's block [width, BLOCK_SIZE] bytes with positions contiguous. Either way the
    # tile is contiguous along the dimension its dot contracts (D for q @ K^T, positions for
    # P @ V), so its bytes cross shared memory once and are converted in registers; and one
    # table entry gives the block, so the addresses are affine and load as 16-byte vectors.
    # MASKED and SKIP (SKIP_PAST_END; a tile the context ends in, `valid` = positions before
    # `end`): the positions past `end` are not read, K's row by row and V's 16 at a time
    # (a mask per position would split V's 16-byte vectors), the last tile of a row being
    # on average half past its end. The positions read past it (V's in the vector holding
    # the end; every one without SKIP) weigh nothing (scores masked, probabilities 0, scales
    # 0); that needs their bytes finite (0 * NaN is NaN): the cache starts zeroed and the
    # store writes no NaN (triton_kv_store.py). Zeroing them after the load instead, any
    # select on the tile, sends it through shared memory a second time (seen in the PTX).
    tile_at = _tile_block(cache_ptr, bt_row_ptr, start, kv_head, stride_b, stride_s, stride_h,
                          BLOCK_SIZE, offs_n.shape[0])
    base = tile_at + offs_n * stride_s
    if V_T:
        ptrs = base[None, :] + offs_d[:, None] * stride_d
        dim_ok = offs_d[:, None] < HEAD_DIM
        pos_ok = (start + offs_n // 16 * 16 < end)[None, :]
    else:
        ptrs = base[:, None] + offs_d[None, :] * stride_d
        dim_ok = offs_d[None, :] < HEAD_DIM
        pos_ok = valid[:, None]
    if MASKED and SKIP:
        if HEAD_DIM == offs_d.shape[0]:
            raw = tl.load(ptrs, mask=pos_ok, other=0)
        else:
            raw = tl.load(ptrs, mask=pos_ok & dim_ok, other=0)
    elif HEAD_DIM == offs_d.shape[0]:
        raw = tl.load(ptrs)
    else:
        raw = tl.load(ptrs, mask=dim_ok, other=0)
    tile = tl.trans(raw.to(tl.float8e4nv, bitcast=True).to(COMPUTE))
    if SCALED:
        if V_T:  # each position's float32 scale: its 4 bytes in rows HEAD_DIM .. + 3 (a
            # 128-position tile over 128 threads loads them a byte each: 4 byte loads)
            bits = _load_masked(base + HEAD_DIM * stride_d, valid, MASKED and SKIP)
            bits = bits.to(tl.int32)
            for j in tl.static_range(1, 4):
                bits = bits | (_load_masked(base + (HEAD_DIM + j) * stride_d, valid,
                                            MASKED and SKIP).to(tl.int32) << (8 * j))
            scale = bits.to(tl.float32, bitcast=True)
        elif K_PLANE:  # the block-head's plane of float32 scales after its values
            first = tl.multiple_of(start % BLOCK_SIZE, offs_n.shape[0])
            plane = (tile_at + (BLOCK_SIZE - first) * stride_s).to(tl.pointer_type(tl.float32))
            scale = _load_masked(plane + first + offs_n, valid, MASKED and SKIP)
        else:  # after the position's values
            scale = _load_masked((base + HEAD_DIM * stride_d).to(tl.pointer_type(tl.float32)),
                                 valid, MASKED and SKIP)
        if MASKED:
            scale = tl.where(valid, scale, 0.0)
    else:
        scale = offs_n.to(tl.float32)
    return tile, scale


@triton.jit
def _load_tiles(
    k_cache_ptr, v_cache_ptr, bt_row, start, offs_n, valid, end, kv_head, offs_d,
    stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr, FP8: tl.constexpr, SCALED: tl.constexpr, COMPUTE: tl.constexpr,
    Q_DTYPE: tl.constexpr, FP8_ASM: tl.constexpr, V_T: tl.constexpr, SKIP: tl.constexpr,
    K_PLANE: tl.constexpr = False,
):
    # -> (K^T [D, N], its scales, V [N, D], its scales) of the tile of positions start + offs_n
    if V_T:  # an fp8 cache, V transposed: each tile in one block (see _load_block_tile)
        k, k_scale = _load_block_tile(k_cache_ptr, bt_row, start, offs_n, valid, end, kv_head,
                                      offs_d, stride_kb, stride_ks, stride_kh, stride_kd,
                                      BLOCK_SIZE, HEAD_DIM, MASKED, SCALED, COMPUTE, False,
                                      SKIP, K_PLANE)
        v, v_scale = _load_block_tile(v_cache_ptr, bt_row, start, offs_n, valid, end, kv_head,
                                      offs_d, stride_vb, stride_vs, stride_vh, stride_vd,
                                      BLOCK_SIZE, HEAD_DIM, MASKED, SCALED, COMPUTE, True,
                                      SKIP)
    else:
        pos = start + offs_n
        k, k_scale = _load_kv_tile(k_cache_ptr, bt_row, pos, valid, kv_head, offs_d,
                                   stride_kb, stride_ks, stride_kh, stride_kd,
                                   BLOCK_SIZE, HEAD_DIM, BLOCK_D, MASKED, True,
                                   FP8, SCALED, Q_DTYPE, FP8_ASM)
        v, v_scale = _load_kv_tile(v_cache_ptr, bt_row, pos, valid, kv_head, offs_d,
                                   stride_vb, stride_vs, stride_vh, stride_vd,
                                   BLOCK_SIZE, HEAD_DIM, BLOCK_D, MASKED, False,
                                   FP8, SCALED, Q_DTYPE, FP8_ASM)
    return k, k_scale, v, v_scale


@triton.jit
def _to_f16(x):
    return tl.minimum(tl.maximum(x.to(tl.float32), -65504.0), 65504.0).to(tl.float16)


@triton.jit
def _online_softmax(s, m_i, l_i):
    # a tile's scores s [M, N] (log2 domain) into the running maximum m_i and sum l_i [M]:
    # (the new maximum, the factor that rescales what came before, P, the new sum)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _softmax_step(q, k, v, k_scale, v_scale, acc, m_i, l_i, allowed, scale_log2,
                  MASKED: tl.constexpr, SCALED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # scores in the log2 domain: exp2(s * scale * log2e) == exp(s * scale)
    if SCALED:  # per-position scales of an fp8 cache (see _load_kv_tile)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * (k_scale * scale_log2)[None, :]
    else:
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
    if MASKED:
        s = tl.where(allowed, s, float("-inf"))
    m_new, alpha, p, l_i = _online_softmax(s, m_i, l_i)
    if SCALED:
        pv = (p * v_scale[None, :]).to(v.dtype)
    else:
        pv = p.to(v.dtype)
    acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _softmax_step_fp8(q, k, v, k_scale, v_scale, acc, m_i, l_i, allowed, row_scale,
                      MASKED: tl.constexpr, SCALED: tl.constexpr, FP8_P: tl.constexpr,
                      EXACT: tl.constexpr):
    # _softmax_step for fp8_attention (torch_attention.fp8_decode_reference states it): q
    # [M, D], K^T and V in e4m3 on the tensor cores; row_scale [M]: q's scale per row times
    # scale * log2(e). FP8_P: P times the V scales over each row's largest in the tile, in
    # e4m3; else P times the V scales in float16, V converted
    s = tl.dot(q, k) * row_scale[:, None]
    if SCALED:
        s = s * k_scale[None, :]
    if MASKED:
        s = tl.where(allowed, s, float("-inf"))
    m_new, alpha, p, l_i = _online_softmax(s, m_i, l_i)
    if SCALED:
        w = v_scale[None, :] + tl.zeros_like(p)
    else:
        w = tl.full(p.shape, 1.0, tl.float32)
    if MASKED:
        w = tl.where(allowed, w, 0.0)
    if FP8_P:
        w_max = tl.maximum(tl.max(w, 1), 1e-30)
        pv = tl.dot(_to_e4m3(p * w / w_max[:, None], EXACT), v) * w_max[:, None]
    else:
        pv = tl.dot((p * w).to(tl.float16), v.to(tl.float16))
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


# ---------------------------------------------------------------------------------------
# decode: one program per (row, kv head, split)


@triton.jit(do_not_specialize=["num_splits"])  # see _NO_RESPECIALIZE
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    qsl_ptr, ctx_ptr, bt_ptr, order_ptr, scale_log2, num_splits,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt,
    NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr, WRITE_OUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr = False, SCALED: tl.constexpr = False, FP8_ASM: tl.constexpr = False,
    LONGEST_FIRST: tl.constexpr = False, V_T: tl.constexpr = False,
    SKIP_PAST: tl.constexpr = False, K_PLANE: tl.constexpr = False, PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    # num_splits is a runtime int (one compiled kernel serves every split count);
    # WRITE_OUT (num_splits == 1) writes the normalized output directly, skipping the reduce
    row, kv_head, split = _decode_program(order_ptr, NUM_Q_HEADS // GROUP, LONGEST_FIRST)
    q_start, is_decode, ctx, tile_lo, tile_hi = _decode_span(qsl_ptr, ctx_ptr, row, split,
                                                             num_splits, BLOCK_N)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_g
    # a scalar condition folded into the bound: `vector & scalar_bool` masks trip the
    # interpreter, and this is one compare on the GPU too
    head_ok = offs_g < tl.where(is_decode, GROUP, 0)
    dim_ok = offs_d < HEAD_DIM
    q = tl.load(q_ptr + q_start.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
                + offs_d[None, :] * stride_qd, mask=head_ok[:, None] & dim_ok[None, :], other=0.0)

    if FP8_ASM:  # an fp8 cache is read into float16 (see _load_kv_tile)
        q = _to_f16(q)
    m_i = tl.full([BLOCK_G], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row = bt_ptr + row.to(tl.int64) * stride_bt
    # every tile is masked at the context end: one compare per position, negligible next to
    # the K/V bytes a decode tile moves
    for tile in range(tile_lo, tile_hi):
        pos = tile * BLOCK_N + offs_n
        valid = pos < ctx
        k, k_scale, v, v_scale = _load_tiles(
            k_cache_ptr, v_cache_ptr, bt_row, tile * BLOCK_N, offs_n, valid, ctx, kv_head,
            offs_d,
            stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh,
            stride_vd, BLOCK_SIZE, HEAD_DIM, BLOCK_D, True, FP8, SCALED, q.dtype,
            q_ptr.dtype.element_ty, FP8_ASM, V_T, SKIP_PAST, K_PLANE)
        acc, m_i, l_i = _softmax_step(q.to(k.dtype), k, v, k_scale, v_scale, acc, m_i, l_i,
                                      valid[None, :], scale_log2, True, SCALED, DOT_PRECISION)

    _decode_out(acc, m_i, l_i, out_ptr, part_o_ptr, part_lse_ptr, row, split, num_splits,
                q_start, heads, head_ok, dim_ok, offs_d, stride_ot, stride_oh, stride_od,
                NUM_Q_HEADS, HEAD_DIM, WRITE_OUT)


@triton.jit
def _decode_program(order_ptr, KV_HEADS: tl.constexpr, LONGEST_FIRST: tl.constexpr):
    # -> (row, kv head, split) of this decode program. LONGEST_FIRST: the grid is (kv head x
    # split, row slot), which the GPU starts in that order, so every program of the longest
    # row first and the shortest rows' last (see _launch_decode); else (row, kv head, split)
    if LONGEST_FIRST:
        kv_head = tl.program_id(0) % KV_HEADS
        split = tl.program_id(0) // KV_HEADS
        row = tl.load(order_ptr + tl.program_id(1))
    else:
        row, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    return row, kv_head, split


@triton.jit
def _decode_span(qsl_ptr, ctx_ptr, row, split, num_splits, BLOCK_N: tl.constexpr):
    # -> (q_start, is_decode, ctx, tile_lo, tile_hi): the row's query token, and the tiles
    # of its context that this split covers. Rows with several tokens belong to the prefill
    # kernel, rows with none are padding: their context counts as empty
    q_start = tl.load(qsl_ptr + row)
    is_decode = tl.load(qsl_ptr + row + 1) - q_start == 1
    ctx = tl.where(is_decode, tl.load(ctx_ptr + row), 0)
    num_tiles = tl.cdiv(ctx, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
    return q_start, is_decode, ctx, tile_lo, tile_hi


@triton.jit
def _decode_out(acc, m_i, l_i, out_ptr, part_o_ptr, part_lse_ptr, row, split, num_splits,
                q_start, heads, head_ok, dim_ok, offs_d, stride_ot, stride_oh, stride_od,
                NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, WRITE_OUT: tl.constexpr):
    # a decode program's result (acc [G, D], running max and sum [G]): normalized into
    # `out` (WRITE_OUT: one split), or as a partial for _reduce_kernel, laid out [row, q
    # head, split, (D)] with its log2-sum-exp. An empty row or split (l == 0) yields 0
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    store_mask = head_ok[:, None] & dim_ok[None, :]
    if WRITE_OUT:
        tl.store(out_ptr + q_start.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
                 + offs_d[None, :] * stride_od, o.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        idx = (row * NUM_Q_HEADS + heads).to(tl.int64) * num_splits + split
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), NEG_BIG)
        tl.store(part_lse_ptr + idx, lse, mask=head_ok)
        tl.store(part_o_ptr + idx[:, None] * HEAD_DIM + offs_d[None, :], o, mask=store_mask)


@triton.jit(do_not_specialize=["num_splits"])  # see _NO_RESPECIALIZE
def _reduce_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, qsl_ptr, num_splits,
    stride_ot, stride_oh, stride_od,
    NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    row = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(qsl_ptr + row)
    q_len = tl.load(qsl_ptr + row + 1) - q_start
    if q_len != 1:  # the decode kernel wrote nothing for this row
        return
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    split_ok = offs_s < num_splits
    base = (row * NUM_Q_HEADS + head).to(tl.int64) * num_splits
    lse = tl.load(part_lse_ptr + base + offs_s, mask=split_ok, other=float("-inf"))
    # lse of empty splits is NEG_BIG (finite): they get weight 0 next to any real split,
    # and an all-empty padding row gets equal weights over zero partials, i.e. 0
    w = tl.exp2(lse - tl.max(lse, 0))
    o = tl.load(part_o_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                mask=split_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    res = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + q_start.to(tl.int64) * stride_ot + head * stride_oh + offs_d * stride_od,
             res.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


# ---------------------------------------------------------------------------------------
# prefill / chunked prefill: one program per (query tile of one row, kv head)


@triton.jit
def _load_fresh(ptr, rows, valid, kv_head, offs_d, stride_t, stride_h, stride_d,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr,
                TRANSPOSED: tl.constexpr):
    # a tile of this step's K or V ([T, Hkv, D], as computed) at tokens `rows`: [D, N] (K^T,
    # TRANSPOSED) or [N, D]; MASKED: only where `valid` (else unused: None)
    at = ptr + kv_head * stride_h
    if TRANSPOSED:
        ptrs = at + rows[None, :].to(tl.int64) * stride_t + offs_d[:, None] * stride_d
        mask = offs_d[:, None] < HEAD_DIM
        if MASKED:
            mask = mask & valid[None, :]
    else:
        ptrs = at + rows[:, None].to(tl.int64) * stride_t + offs_d[None, :] * stride_d
        mask = offs_d[None, :] < HEAD_DIM
        if MASKED:
            mask = mask & valid[:, None]
    if MASKED or HEAD_DIM != BLOCK_D:
        x = tl.load(ptrs, mask=mask, other=0.0)
    else:  # a full tile of a power-of-2 head_dim: unmasked
        x = tl.load(ptrs)
    return x


@triton.jit
def _prefill_fresh(
    q, acc, m_i, l_i, kn_ptr, vn_ptr, q_start, q_len, t0, tok, kv_head, offs_n, offs_d,
    scale_log2, stride_knt, stride_knh, stride_knd, stride_vnt, stride_vnh, stride_vnd,
    BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # _prefill_kernel's tiles of the row's own positions with FRESH: position prefix + j
    # from this step's K/V (kn, vn, in q's dtype: a bf16 cache's bytes, an fp8 cache's
    # before rounding), as over a bf16 cache; query token t sees j <= t
    kv_len = tl.minimum(t0 + BLOCK_Q, q_len)
    full_end = tl.minimum((t0 + 1) // BLOCK_N * BLOCK_N, kv_len)  # wholly at or before t0
    no_scale = offs_n.to(tl.float32)
    for j0 in range(0, full_end, BLOCK_N):
        rows = q_start + j0 + offs_n
        k = _load_fresh(kn_ptr, rows, None, kv_head, offs_d, stride_knt, stride_knh,
                        stride_knd, HEAD_DIM, BLOCK_D, False, True)
        v = _load_fresh(vn_ptr, rows, None, kv_head, offs_d, stride_vnt, stride_vnh,
                        stride_vnd, HEAD_DIM, BLOCK_D, False, False)
        acc, m_i, l_i = _softmax_step(q, k, v, no_scale, no_scale, acc, m_i, l_i, None,
                                      scale_log2, False, False, DOT_PRECISION)
    for j0 in range(full_end, kv_len, BLOCK_N):
        j = j0 + offs_n
        valid = j < kv_len
        k = _load_fresh(kn_ptr, q_start + j, valid, kv_head, offs_d, stride_knt, stride_knh,
                        stride_knd, HEAD_DIM, BLOCK_D, True, True)
        v = _load_fresh(vn_ptr, q_start + j, valid, kv_head, offs_d, stride_vnt, stride_vnh,
                        stride_vnd, HEAD_DIM, BLOCK_D, True, False)
        allowed = valid[None, :] & (j[None, :] <= tok[:, None])
        acc, m_i, l_i = _softmax_step(q, k, v, no_scale, no_scale, acc, m_i, l_i, allowed,
                                      scale_log2, True, False, DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["num_rows"])  # see _NO_RESPECIALIZE
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, kn_ptr, vn_ptr,
    qsl_ptr, ctx_ptr, bt_ptr, scale_log2, num_rows,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_knt, stride_knh, stride_knd, stride_vnt, stride_vnh, stride_vnd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    SKIP_DECODE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr = False, SCALED: tl.constexpr = False, FP8_ASM: tl.constexpr = False,
    V_T: tl.constexpr = False, FP8_MMA: tl.constexpr = False, FP8_P: tl.constexpr = False,
    EXACT: tl.constexpr = False, K_PLANE: tl.constexpr = False, FRESH: tl.constexpr = False,
):
    # FP8_MMA (fp8_attention, over a transposed V cache): q in e4m3, a scale per row, and
    # the tiles' bytes as they are go to the fp8 tensor cores (_softmax_step_fp8).
    # FRESH (paged_attention's `fresh`): the row's own positions (prefix ..) come from this
    # step's K/V as computed, kn/vn [T, Hkv, D] in q's dtype, and only the earlier ones from
    # the cache (_prefill_fresh)
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    # Row i owns programs [qsl[i] // BLOCK_Q + i, qsl[i+1] // BLOCK_Q + i + 1), which holds
    # its cdiv(query_len, BLOCK_Q) tiles; so T // BLOCK_Q + num_rows programs cover any
    # batch of T tokens without reading lengths on the host. Find the row by binary search.
    lo = pid * 0  # int32 scalars; num_rows may arrive specialized as the constant 1
    hi = lo + num_rows
    while hi - lo > 1:
        mid = (lo + hi) // 2
        go_right = tl.load(qsl_ptr + mid) // BLOCK_Q + mid <= pid
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    row = lo
    q_start = tl.load(qsl_ptr + row)
    q_len = tl.load(qsl_ptr + row + 1) - q_start
    t0 = (pid - (q_start // BLOCK_Q + row)) * BLOCK_Q
    if t0 >= q_len:
        return
    if SKIP_DECODE:
        if q_len == 1:  # the decode kernel (with its KV splits) owns single-token rows
            return
    ctx = tl.load(ctx_ptr + row)
    prefix = ctx - q_len  # the row's queries sit at context positions prefix .. ctx - 1

    offs_m = tl.arange(0, BLOCK_Q * BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    tok = t0 + offs_m // BLOCK_G  # M packs (token, head of the group), head fastest
    g = offs_m % BLOCK_G
    heads = kv_head * GROUP + g
    row_ok = (tok < q_len) & (g < GROUP)
    dim_ok = offs_d < HEAD_DIM
    q_off = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_off[:, None] * stride_qt + heads[:, None] * stride_qh
                + offs_d[None, :] * stride_qd, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q_pos = prefix + tok

    m_i = tl.full([BLOCK_Q * BLOCK_G], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_D], tl.float32)
    bt_row = bt_ptr + row.to(tl.int64) * stride_bt
    first_pos = prefix + t0
    kv_end = prefix + tl.minimum(t0 + BLOCK_Q, q_len)
    # tiles wholly at or before the tile's first query position need no mask at all
    full_end = tl.minimum((first_pos + 1) // BLOCK_N * BLOCK_N, kv_end)
    if FRESH:  # (not with FP8_MMA: paged_attention drops `fresh` for fp8_attention)
        # the row's own positions from this step's K/V, then the cache's before them only
        # (their causal mask below always holds)
        acc, m_i, l_i = _prefill_fresh(
            q, acc, m_i, l_i, kn_ptr, vn_ptr, q_start, q_len, t0, tok, kv_head, offs_n,
            offs_d, scale_log2, stride_knt, stride_knh, stride_knd, stride_vnt, stride_vnh,
            stride_vnd, BLOCK_Q, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION)
        kv_end = prefix
        full_end = prefix // BLOCK_N * BLOCK_N
    if FP8_MMA:
        q, q_scale = _rows_to_e4m3(q, EXACT)
        row_scale = q_scale * scale_log2
    elif FP8_ASM:  # an fp8 cache is read into float16 (see _load_kv_tile)
        q = _to_f16(q)
    elif not FP8:  # or into the query's dtype
        q = q.to(k_cache_ptr.dtype.element_ty)
    for start in range(0, full_end, BLOCK_N):
        pos = start + offs_n
        k, k_scale, v, v_scale = _load_tiles(
            k_cache_ptr, v_cache_ptr, bt_row, start, offs_n, pos < kv_end, kv_end, kv_head,
            offs_d,
            stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh,
            stride_vd, BLOCK_SIZE, HEAD_DIM, BLOCK_D, False, FP8, SCALED, q.dtype,
            q_ptr.dtype.element_ty, FP8_ASM, V_T, False, K_PLANE)
        if FP8_MMA:
            acc, m_i, l_i = _softmax_step_fp8(q, k, v, k_scale, v_scale, acc, m_i, l_i, None,
                                              row_scale, False, SCALED, FP8_P, EXACT)
        else:
            acc, m_i, l_i = _softmax_step(q, k, v, k_scale, v_scale, acc, m_i, l_i, None,
                                          scale_log2, False, SCALED, DOT_PRECISION)
    # diagonal tiles: causal mask, and the context end (kv_end <= ctx) for the last one
    for start in range(full_end, kv_end, BLOCK_N):
        pos = start + offs_n
        valid = pos < kv_end
        k, k_scale, v, v_scale = _load_tiles(
            k_cache_ptr, v_cache_ptr, bt_row, start, offs_n, valid, kv_end, kv_head, offs_d,
            stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh,
            stride_vd, BLOCK_SIZE, HEAD_DIM, BLOCK_D, True, FP8, SCALED, q.dtype,
            q_ptr.dtype.element_ty, FP8_ASM, V_T, False, K_PLANE)
        allowed = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        if FP8_MMA:
            acc, m_i, l_i = _softmax_step_fp8(q, k, v, k_scale, v_scale, acc, m_i, l_i,
                                              allowed, row_scale, True, SCALED, FP8_P, EXACT)
        else:
            acc, m_i, l_i = _softmax_step(q, k, v, k_scale, v_scale, acc, m_i, l_i, allowed,
                                          scale_log2, True, SCALED, DOT_PRECISION)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_off[:, None] * stride_ot + heads[:, None] * stride_oh
             + offs_d[None, :] * stride_od, o.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dim_ok[None, :])


# ---------------------------------------------------------------------------------------
# entry point


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    num_splits: int | None = None,
    prefill_config: TileConfig | None = None,
    decode_config: TileConfig | None = None,
    longest_first: bool = LONGEST_FIRST,
    fp8_attention: str = "off",
    fresh: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention of q ([T, Hq, D], any strides) over each row's cached context; [T, Hq, D].

    Same contract as `torch_attention.paged_attention`. `num_splits` fixes the decode KV
    splits (default: `choose_num_splits` from the row count and meta.max_context_len);
    the configs override tile sizes; `longest_first` starts the decode programs of the
    longest contexts first (same results, another order). `fp8_attention` ("q" | "qp",
    over an fp8 cache): decode rows run triton_fp8_decode's kernel, q (and P) in e4m3 on
    the fp8 tensor cores. `fresh`: this step's K and V ([T, Hkv, D] each, in q's dtype, as
    stored): prefill rows read their own positions from them, the earlier ones from the
    cache (the same values over a cache of q's dtype; over an fp8 one, the values before
    rounding); decode rows, and fp8_attention, read the cache only. See the module
    docstring for what a launch bakes in.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads is not a multiple of {num_kv_heads} kv heads")
    out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    num_rows = meta.context_lens.shape[0]
    if num_tokens == 0 or num_rows == 0:
        return out
    group = num_q_heads // num_kv_heads
    scale_log2 = scale * LOG2E

    def launch_decode() -> None:
        if fp8_attention != "off":
            # (imported here: that module builds on this one)
            from nanovllm.kernels.triton_fp8_decode import decode_fp8

            decode_fp8(q, k_cache, v_cache, meta, scale, fp8_p=fp8_attention == "qp",
                       num_splits=num_splits, out=out,
                       order=_longest_first(meta) if longest_first else None)
            return
        _launch_decode(q, k_cache, v_cache, out, scale_log2, num_rows, group,
                       meta.max_context_len, num_splits, decode_config,
                       qsl=meta.query_start_loc, ctx=meta.context_lens, bt=meta.block_tables,
                       order=_longest_first(meta) if longest_first else None)

    if meta.max_query_len == 1:
        launch_decode()
        return out
    has_decode_rows = 1 in meta.query_lens_host
    if has_decode_rows:
        launch_decode()
    flags = _fp8_flags(k_cache, v_cache, head_dim, q)
    if fp8_attention != "off":
        fresh = None
    # an fp8 cache's tiles with `fresh` too (on the H200 a seed prefill step 0.236 ms against
    # 0.261 with a bf16 cache's, a chunk of 8 x 512 after 1,536 0.291 against 0.396)
    cfg = prefill_config or default_prefill_config(head_dim, meta.max_query_len, group,
                                                    q.dtype, fp8=flags["FP8"])
    if fp8_attention != "off":  # q (and P) in e4m3, over tiles of FP8_MMA_TILE positions
        if not (flags["FP8"] and flags["V_T"]) or k_cache.shape[1] % FP8_MMA_TILE:
            raise ValueError("fp8_attention needs an fp8 cache with V transposed, in blocks "
                             f"of a multiple of {FP8_MMA_TILE} tokens")
        cfg = dataclasses.replace(cfg, block_n=FP8_MMA_TILE)
        flags |= dict(FP8_MMA=True, FP8_P=fp8_attention == "qp", EXACT=not q.is_cuda)
    block_g = _pow2(group)
    if cfg.block_m % block_g or cfg.block_m < 16:
        raise ValueError(f"block_m={cfg.block_m} must be >= 16 and a multiple of {block_g}")
    block_q = cfg.block_m // block_g
    grid = (num_tokens // block_q + num_rows, num_kv_heads)
    if fresh is None:
        kn = vn = q  # unread (FRESH off)
        fresh_strides = (0,) * 6
    else:
        kn, vn = fresh
        if kn.shape != (num_tokens, num_kv_heads, head_dim) or vn.shape != kn.shape \
                or kn.dtype != q.dtype or vn.dtype != q.dtype:
            raise ValueError(f"fresh K/V must be [{num_tokens}, {num_kv_heads}, {head_dim}] in "
                             f"{q.dtype}; got {tuple(kn.shape)} {kn.dtype}, "
                             f"{tuple(vn.shape)} {vn.dtype}")
        fresh_strides = (*kn.stride(), *vn.stride())
        flags["FRESH"] = True
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, kn, vn,
        meta.query_start_loc, meta.context_lens, meta.block_tables, scale_log2, num_rows,
        *q.stride(), *out.stride(), *fresh_strides, *k_cache.stride(), *v_cache.stride(),
        meta.block_tables.stride(0),
        GROUP=group, BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim, BLOCK_D=_pow2(head_dim),
        BLOCK_Q=block_q, BLOCK_G=block_g, BLOCK_N=_block_n(cfg, k_cache, flags),
        SKIP_DECODE=has_decode_rows, DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **flags,
    )
    return out


def _block_n(cfg: TileConfig, k_cache: torch.Tensor, flags: dict) -> int:
    # a transposed V cache's tiles must each lie in one block (see _load_block_tile)
    return min(cfg.block_n, k_cache.shape[1]) if flags["V_T"] else cfg.block_n


def _register_cap(cfg: TileConfig, q: torch.Tensor) -> dict:
    # the launch option of TileConfig.max_registers, for compiled kernels only
    return {"maxnreg": cfg.max_registers} if cfg.max_registers and q.is_cuda else {}


def _longest_first(meta: AttentionMetadata) -> torch.Tensor:
    """The rows by context length, longest first, ties in row order ([B] int32), ranked on
    the device once per step (every layer shares it; a CUDA graph replays the launch)."""
    order = meta.derived.get("longest_first")
    if order is None:
        lens = meta.context_lens
        if not RANK_KERNEL:
            order = torch.sort(lens, descending=True, stable=True).indices.to(torch.int32)
        else:
            order = torch.empty(lens.shape[0], dtype=torch.int32, device=lens.device)
            if lens.shape[0]:
                _rank_kernel[(lens.shape[0],)](lens, order, lens.shape[0], BLOCK=RANK_BLOCK,
                                               num_warps=4, **pdl_launch(lens))
        meta.derived["longest_first"] = order
    return order


@triton.jit(do_not_specialize=["num_rows"])  # see _NO_RESPECIALIZE
def _rank_kernel(ctx_ptr, order_ptr, num_rows, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    # program i puts row i at its place: the rows with longer contexts, and the rows before it
    # with as long a one, go ahead of it (RANK_KERNEL). The rows are counted BLOCK at a time,
    # so one compiled variant serves every row count.
    pdl_enter(PDL)
    i = tl.program_id(0)
    mine = tl.load(ctx_ptr + i)
    ahead = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, num_rows, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        lens = tl.load(ctx_ptr + offs, mask=offs < num_rows, other=-1)
        ahead += ((lens > mine) | ((lens == mine) & (offs < i))).to(tl.int32)
    tl.store(order_ptr + tl.sum(ahead, 0), i)


def _launch_decode(q, k_cache, v_cache, out, scale_log2, num_rows, group, max_context_len,
                   num_splits, cfg, qsl, ctx, bt, order) -> None:
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    flags = _fp8_flags(k_cache, v_cache, head_dim, q)
    cfg = cfg or default_decode_config(head_dim, q.dtype, fp8=flags["FP8"])
    if num_splits is None:
        num_splits = choose_num_splits(num_rows, num_kv_heads, max_context_len,
                                       _num_sms(q.device))
    part_o, part_lse = split_partials(out, num_rows, num_splits)
    # Programs start in grid order, x fastest. In batch order a long row may start last and
    # run alone at the end; longest first, the last to start are the shortest (LPT order).
    grid = ((num_rows, num_kv_heads, num_splits) if order is None
            else (num_kv_heads * num_splits, num_rows))
    _decode_kernel[grid](
        q, k_cache, v_cache, out, part_o, part_lse, qsl, ctx, bt,
        ctx if order is None else order, scale_log2, num_splits,
        *q.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride(), bt.stride(0),
        NUM_Q_HEADS=num_q_heads, GROUP=group, BLOCK_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim, BLOCK_D=_pow2(head_dim), BLOCK_G=max(cfg.block_m, _pow2(group)),
        BLOCK_N=_block_n(cfg, k_cache, flags), WRITE_OUT=num_splits == 1,
        DOT_PRECISION=_dot_precision(q.dtype), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, LONGEST_FIRST=order is not None, SKIP_PAST=SKIP_PAST_END,
        **flags, **pdl_launch(q),
        **_register_cap(cfg, q),
    )
    reduce_splits(part_o, part_lse, out, qsl, num_rows, num_splits)


def split_partials(out: torch.Tensor, num_rows: int, num_splits: int):
    """(part_o, part_lse) for a decode launch of `num_splits` splits: [rows, q heads, splits,
    (D)] float32, or `out` twice for one split (the kernel writes `out` directly and never
    touches these)."""
    if num_splits == 1:
        return out, out
    _, num_q_heads, head_dim = out.shape
    return (torch.empty((num_rows, num_q_heads, num_splits, head_dim), dtype=torch.float32,
                        device=out.device),
            torch.empty((num_rows, num_q_heads, num_splits), dtype=torch.float32,
                        device=out.device))


def reduce_splits(part_o, part_lse, out, qsl, num_rows: int, num_splits: int) -> None:
    """Combine a decode launch's splits into `out` (nothing to do for one split)."""
    if num_splits > 1:
        _, num_q_heads, head_dim = out.shape
        _reduce_kernel[(num_rows, num_q_heads)](
            part_o, part_lse, out, qsl, num_splits, *out.stride(),
            NUM_Q_HEADS=num_q_heads, HEAD_DIM=head_dim, BLOCK_D=_pow2(head_dim),
            BLOCK_S=_pow2(num_splits), num_warps=4, **pdl_launch(out),
        )
