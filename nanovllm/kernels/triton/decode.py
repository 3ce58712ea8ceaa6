"""Decode attention in Triton: rows with one query token (attention.py sends them here).

One program per (row, kv head, split): the kv head's GQA query heads are the M dimension of
`tl.dot` (padded to a power of 2; Triton pads the dot to the tensor cores' 16 rows), so each
K/V tile is read once per group. With num_splits > 1 each split covers a slice of the
context and writes a partial (normalized acc, log2-sum-exp), and `_reduce_kernel` combines
the splits (flash-decoding). The grid is (kv head x split, row slot) and slot i runs the
i-th longest row, ranked on the device (decode.py): the GPU starts programs in grid
order, so no long row starts last and runs alone at the end. An fp8 cache's tiles read
nothing past the context's end (`_load_block_tile`'s SKIP).

A launch bakes in num_rows (= context_lens.shape[0]), the heads, head_dim, block_size,
dtype, the block table's width (its stride), num_splits (from num_rows and
meta.max_context_len, or the caller's) and the tile config; the lengths, tables and query
positions are read on the device, so a captured decode graph replays with new values of
them. Any num_splits is correct for any context lengths: splits past a row's context are
empty and weigh nothing in the reduction. A padding row (context_len 0) reads nothing and
gives zeros in its output row, or nothing if its query_len is 0.
"""

import torch
import triton
import triton.language as tl

from nanovllm.kernels.attention_metadata import AttentionMetadata
from nanovllm.kernels.triton.launch import num_sms, pdl_enter, pdl_launch
from nanovllm.kernels.triton.tiles import (
    NEG_BIG,
    TileConfig,
    _block_n,
    _dot_precision,
    _load_tiles,
    _pow2,
    _register_cap,
    _softmax_step,
    _to_f16,
    cache_flags,
)

# split-KV heuristic (see `choose_num_splits`)
TARGET_PROGRAMS_PER_SM = 4  # bf16 d128 decode programs fit ~5 per SM (regs and smem)
MIN_SPLIT_TOKENS = 256  # fewer tokens per split and the partial write + reduce dominate
MAX_SPLITS = 64
RANK_BLOCK = 128  # rows a _rank_kernel program compares at a time
FP8_DECODE_REGISTERS = 128  # an fp8 cache's decode: 4 programs of 4 warps an SM


def default_decode_config(head_dim: int, dtype: torch.dtype = torch.bfloat16,
                          fp8: bool = False) -> TileConfig:
    """`fp8`: the cache holds fp8 bytes, so a tile of 128 positions moves a bf16 tile of
    64's bytes (fp8 V tiles stay within one block, hence the 128-token blocks of an fp8
    cache, engine/resolve.py)."""
    if dtype == torch.float32:
        return TileConfig(block_m=16, block_n=32, num_warps=8, num_stages=2)
    if head_dim <= 128:
        return DECODE_TILES["fp8" if fp8 else "bf16"]
    return TileConfig(block_m=16, block_n=32, num_warps=4, num_stages=2)


# The decode's tiles for head_dim <= 128, by cache. fp8: ptxas gave it ~147 registers a
# thread, so 3 programs an SM; capped at 128 (a few bytes spilled), 4 fit, and the decode
# reads faster. bf16 d128: ~91 registers, 39 KB of shared memory, so 5 programs fit an SM.
# At these stages each K/V tile has one buffer. block_m=1: the dots span the GQA group's
# heads only (padded to a power of 2; Triton pads them to the tensor cores' 16 rows), so
# the softmax works on the real rows, not on 16 rows of which most are padding.
DECODE_TILES = {
    "fp8": TileConfig(block_m=1, block_n=128, num_warps=4, num_stages=2,
                      max_registers=FP8_DECODE_REGISTERS),
    "bf16": TileConfig(block_m=1, block_n=64, num_warps=4, num_stages=3),
}


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


@triton.jit(do_not_specialize=["num_splits"])  # see tiles.py' _NO_RESPECIALIZE
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
    FP8: tl.constexpr = False, FP8_ASM: tl.constexpr = False,
    V_T: tl.constexpr = False, PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    # num_splits is a runtime int (one compiled kernel serves every split count);
    # WRITE_OUT (num_splits == 1) writes the normalized output directly, skipping the reduce
    # the grid is (kv head x split, row slot): every program of the longest row first
    kv_heads: tl.constexpr = NUM_Q_HEADS // GROUP
    kv_head = tl.program_id(0) % kv_heads
    split = tl.program_id(0) // kv_heads
    row = tl.load(order_ptr + tl.program_id(1))
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
            stride_vd, BLOCK_SIZE, HEAD_DIM, BLOCK_D, True, FP8, q.dtype,
            q_ptr.dtype.element_ty, FP8_ASM, V_T, True)
        acc, m_i, l_i = _softmax_step(q.to(k.dtype), k, v, k_scale, v_scale, acc, m_i, l_i,
                                      valid[None, :], scale_log2, True, FP8, DOT_PRECISION)

    _decode_out(acc, m_i, l_i, out_ptr, part_o_ptr, part_lse_ptr, row, split, num_splits,
                q_start, heads, head_ok, dim_ok, offs_d, stride_ot, stride_oh, stride_od,
                NUM_Q_HEADS, HEAD_DIM, WRITE_OUT)


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


@triton.jit(do_not_specialize=["num_splits"])  # see tiles.py' _NO_RESPECIALIZE
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


def launch_decode(q, k_cache, v_cache, out, scale_log2: float, meta: AttentionMetadata,
                  num_splits: int | None = None, cfg: TileConfig | None = None) -> None:
    """The attention of meta's decode rows into `out` (triton.attention.paged_attention's
    arguments), the rows started longest first."""
    num_rows = meta.context_lens.shape[0]
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    qsl, ctx, bt = meta.query_start_loc, meta.context_lens, meta.block_tables
    max_context_len = meta.max_context_len
    flags = cache_flags(k_cache, v_cache, q)
    cfg = cfg or default_decode_config(head_dim, q.dtype, fp8=flags["FP8"])
    if num_splits is None:
        num_splits = choose_num_splits(num_rows, num_kv_heads, max_context_len,
                                       num_sms(q.device))
    part_o, part_lse = split_partials(out, num_rows, num_splits)
    # Programs start in grid order, x fastest: the last to start are the shortest rows'
    # (LPT order), so no long row runs alone at the end
    grid = (num_kv_heads * num_splits, num_rows)
    _decode_kernel[grid](
        q, k_cache, v_cache, out, part_o, part_lse, qsl, ctx, bt,
        longest_first(meta), scale_log2, num_splits,
        *q.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride(), bt.stride(0),
        NUM_Q_HEADS=num_q_heads, GROUP=group, BLOCK_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim, BLOCK_D=_pow2(head_dim), BLOCK_G=max(cfg.block_m, _pow2(group)),
        BLOCK_N=_block_n(cfg, k_cache, flags), WRITE_OUT=num_splits == 1,
        DOT_PRECISION=_dot_precision(q.dtype), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **flags, **pdl_launch(q), **_register_cap(cfg, q),
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


# ---- the decode rows longest first: one launch of B small programs ranks them once a step
# (torch's sort would be a radix sort of several launches)

def longest_first(meta: AttentionMetadata) -> torch.Tensor:
    """The rows by context length, longest first, ties in row order ([B] int32), ranked on
    the device once per step (every layer shares it; a CUDA graph replays the launch)."""
    order = meta.derived.get("longest_first")
    if order is None:
        lens = meta.context_lens
        order = torch.empty(lens.shape[0], dtype=torch.int32, device=lens.device)
        if lens.shape[0]:
            _rank_kernel[(lens.shape[0],)](lens, order, lens.shape[0], BLOCK=RANK_BLOCK,
                                           num_warps=4, **pdl_launch(lens))
        meta.derived["longest_first"] = order
    return order


@triton.jit(do_not_specialize=["num_rows"])  # see tiles.py' _NO_RESPECIALIZE
def _rank_kernel(ctx_ptr, order_ptr, num_rows, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    # program i puts row i at its place: the rows with longer contexts, and the rows before it
    # with as long a one, go ahead of it. The rows are counted BLOCK at a time,
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
