"""What the Triton attention kernels share: tile sizes, the loads of a K/V tile from the paged
cache (bf16, or fp8 bytes converted in registers), and one step of the online softmax.

`decode.py` (one query token a row) and `prefill.py` (several) loop over tiles
of a row's context with these; `attention.py` picks between them. The cache's layout
is worker/kv_cache.py's: K rows of values (an fp8 row with its token-head's float32 scale,
or the scales in a plane after a head-major block's values), V the same or, over an fp8
cache, stored transposed within each block, so that both tiles reach the tensor cores from
one trip through shared memory, as bytes, converted to float16 in registers
(`_load_block_tile`); a row-major V (blocks of under 16 tokens) takes `_load_kv_tile`'s PTX
conversion.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanovllm.kernels.torch_attention import k_scale_plane, v_transposed

LOG2E = 1.4426950408889634
# a finite "minus infinity" for running maxima, so a row that has seen no key yet gives
# exp2(m_old - m_new) = 1 instead of exp2(-inf + inf) = NaN
NEG_BIG = tl.constexpr(-1.0e30)
# _NO_RESPECIALIZE: Triton compiles a variant per integer argument that is 1 or divisible by
# 16; arguments that change from step to step (row and split counts) are kept generic, so
# a step of a new size never compiles a kernel in the middle of serving


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes and launch options of one kernel (tests shrink them; benchmarks sweep)."""

    # prefill: query rows per program (tokens x padded GQA group); decode: the fewest rows
    # of its dots (the GQA group's heads padded to a power of 2, at least block_m; Triton pads
    # a dot under the tensor cores' 16 rows itself, but the softmax then works on the real
    # rows only)
    block_m: int
    block_n: int  # KV positions per tile; any multiple or fraction of the cache block size
    num_warps: int = 4
    num_stages: int = 2
    # ptxas' register cap a thread (None: its own choice): fewer registers fit more programs
    # on an SM; applied on a GPU only (the interpreter has no registers)
    max_registers: int | None = None


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs would silently use tf32 tensor cores; the fp32 path is the exact one
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_n(cfg: TileConfig, k_cache: torch.Tensor, flags: dict) -> int:
    # a transposed V cache's tiles must each lie in one block (see _load_block_tile)
    return min(cfg.block_n, k_cache.shape[1]) if flags["V_T"] else cfg.block_n


def _register_cap(cfg: TileConfig, q: torch.Tensor) -> dict:
    # the launch option of TileConfig.max_registers, for compiled kernels only
    return {"maxnreg": cfg.max_registers} if cfg.max_registers and q.is_cuda else {}


@triton.jit
def _load_kv_tile(
    cache_ptr, bt_row_ptr, pos, valid, kv_head, offs_d,
    stride_b, stride_s, stride_h, stride_d,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr, TRANSPOSED: tl.constexpr,
    FP8: tl.constexpr = False, COMPUTE: tl.constexpr = None,
    FP8_ASM: tl.constexpr = False,
):
    # -> (tile, scale). FP8: the tile's e4m3 values come back as COMPUTE (the query's dtype),
    # unscaled, and `scale` holds each position's float32 scale, which the caller
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
    if FP8:
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
    COMPUTE: tl.constexpr, V_T: tl.constexpr, SKIP: tl.constexpr,
):
    # -> (tile in COMPUTE, scale [N]) of an fp8 cache whose tile of positions
    # start .. start + N - 1 lies in one block: K^T [D, N] from K's head-major rows of
    # positions (its scales in the block-head's plane after the values), or,
    # V_T, V [N, D] from a V cache stored transposed within each block (worker/kv_cache.py),
    # a head's block [width, BLOCK_SIZE] bytes with positions contiguous. Either way the
    # tile is contiguous along the dimension its dot contracts (D for q @ K^T, positions for
    # P @ V), so its bytes cross shared memory once and are converted in registers; and one
    # table entry gives the block, so the addresses are affine and load as 16-byte vectors.
    # MASKED and SKIP (a decode's tile the context ends in, `valid` = positions before
    # `end`): the positions past `end` are not read, K's row by row and V's 16 at a time
    # (a mask per position would split V's 16-byte vectors), the last tile of a row being
    # on average half past its end. The positions read past it (V's in the vector holding
    # the end; every one without SKIP) weigh nothing (scores masked, probabilities 0, scales
    # 0); that needs their bytes finite (0 * NaN is NaN): the cache starts zeroed and the
    # store writes no NaN (kv_store.py). Zeroing them after the load instead, any
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
    if V_T:  # each position's float32 scale: its 4 bytes in rows HEAD_DIM .. + 3 (a
        # 128-position tile over 128 threads loads them a byte each: 4 byte loads)
        bits = _load_masked(base + HEAD_DIM * stride_d, valid, MASKED and SKIP)
        bits = bits.to(tl.int32)
        for j in tl.static_range(1, 4):
            bits = bits | (_load_masked(base + (HEAD_DIM + j) * stride_d, valid,
                                        MASKED and SKIP).to(tl.int32) << (8 * j))
        scale = bits.to(tl.float32, bitcast=True)
    else:  # the block-head's plane of float32 scales after its values
        first = tl.multiple_of(start % BLOCK_SIZE, offs_n.shape[0])
        plane = (tile_at + (BLOCK_SIZE - first) * stride_s).to(tl.pointer_type(tl.float32))
        scale = _load_masked(plane + first + offs_n, valid, MASKED and SKIP)
    if MASKED:
        scale = tl.where(valid, scale, 0.0)
    return tile, scale


@triton.jit
def _load_tiles(
    k_cache_ptr, v_cache_ptr, bt_row, start, offs_n, valid, end, kv_head, offs_d,
    stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr, FP8: tl.constexpr, COMPUTE: tl.constexpr,
    Q_DTYPE: tl.constexpr, FP8_ASM: tl.constexpr, V_T: tl.constexpr, SKIP: tl.constexpr,
):
    # -> (K^T [D, N], its scales, V [N, D], its scales) of the tile of positions start + offs_n
    if V_T:  # an fp8 cache, V transposed: each tile in one block (see _load_block_tile)
        k, k_scale = _load_block_tile(k_cache_ptr, bt_row, start, offs_n, valid, end, kv_head,
                                      offs_d, stride_kb, stride_ks, stride_kh, stride_kd,
                                      BLOCK_SIZE, HEAD_DIM, MASKED, COMPUTE, False,
                                      SKIP)
        v, v_scale = _load_block_tile(v_cache_ptr, bt_row, start, offs_n, valid, end, kv_head,
                                      offs_d, stride_vb, stride_vs, stride_vh, stride_vd,
                                      BLOCK_SIZE, HEAD_DIM, MASKED, COMPUTE, True,
                                      SKIP)
    else:
        pos = start + offs_n
        k, k_scale = _load_kv_tile(k_cache_ptr, bt_row, pos, valid, kv_head, offs_d,
                                   stride_kb, stride_ks, stride_kh, stride_kd,
                                   BLOCK_SIZE, HEAD_DIM, BLOCK_D, MASKED, True,
                                   FP8, Q_DTYPE, FP8_ASM)
        v, v_scale = _load_kv_tile(v_cache_ptr, bt_row, pos, valid, kv_head, offs_d,
                                   stride_vb, stride_vs, stride_vh, stride_vd,
                                   BLOCK_SIZE, HEAD_DIM, BLOCK_D, MASKED, False,
                                   FP8, Q_DTYPE, FP8_ASM)
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
                  MASKED: tl.constexpr, FP8: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # scores in the log2 domain: exp2(s * scale * log2e) == exp(s * scale)
    if FP8:  # per-position scales of an fp8 cache (see _load_kv_tile)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * (k_scale * scale_log2)[None, :]
    else:
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
    if MASKED:
        s = tl.where(allowed, s, float("-inf"))
    m_new, alpha, p, l_i = _online_softmax(s, m_i, l_i)
    if FP8:
        pv = (p * v_scale[None, :]).to(v.dtype)
    else:
        pv = p.to(v.dtype)
    acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


def cache_flags(k_cache: torch.Tensor, v_cache: torch.Tensor,
                q: torch.Tensor | None = None) -> dict:
    """The cache format's kernel flags. FP8: a cache of bytes holds float8 e4m3
    (kv_cache_dtype="fp8"), each token-head's float32 scale after its values
    (torch_attention's format); V_T: the V cache is stored transposed
    within each block (worker/kv_cache.py), and then the K cache keeps each block-head's
    scales in a plane after its values (torch_attention.k_scale_plane). With the attention's
    query `q`: FP8_ASM, whether the tiles are converted by PTX into float16 and the dots run
    in float16 (a bf16/fp16 query on a GPU; see _load_kv_tile)."""
    fp8 = k_cache.dtype == torch.uint8
    flags = dict(FP8=fp8, V_T=v_transposed(v_cache))
    if flags["V_T"] != k_scale_plane(k_cache):
        raise ValueError("a V cache stored transposed goes with a K cache with a scale plane")
    if q is not None:
        flags["FP8_ASM"] = fp8 and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
    return flags
