"""Prefill attention in Triton: rows with several query tokens (a prompt, or a chunk of one
over its cached prefix; attention.py sends them here).

One program per (tile of BLOCK_Q tokens of one row, kv head), with M = BLOCK_Q tokens x the
group's query heads; the causal mask is applied only to the tiles that straddle the
diagonal. A launch bakes in T (= q.shape[0]), num_rows, the heads, head_dim, block_size,
dtype, BLOCK_Q (from meta.max_query_len) and the tile config; where each row's tokens lie
is found on the device (`_prefill_kernel`), so no lengths are read on the host.

`fresh` (over an fp8 cache): a row's own positions come from this step's K/V as computed
and only the earlier ones from the cache (`_prefill_fresh`), so a chunk reads its own
values unrounded.
"""

import torch
import triton
import triton.language as tl

from nanovllm.kernels.attention_metadata import AttentionMetadata
from nanovllm.kernels.triton.tiles import (
    NEG_BIG,
    TileConfig,
    _block_n,
    _dot_precision,
    _load_tiles,
    _pow2,
    _softmax_step,
    _to_f16,
    cache_flags,
)

PREFILL_BLOCK_N, PREFILL_STAGES = 32, 3  # a bf16 cache's prefill tiles (default_prefill_config)
FP8_PREFILL_STAGES = 3  # an fp8 cache's (64 x 64 tiles at 4 warps)


def default_prefill_config(
    head_dim: int, max_query_len: int, group: int, dtype: torch.dtype = torch.bfloat16,
    fp8: bool = False,
) -> TileConfig:
    # Sized on sm_90 to compile without register spills (`python -m tests.model.sm90_ptx`
    # reports ptxas' registers and spills): bf16 d128 at ~150 regs; the fp8 cache's tiles at
    # the 255 cap (no spill with the device's Triton 3.6). fp32 is the exact test path; its
    # "ieee" dot runs on FMAs, so small tiles.
    # A bf16 cache's KV tiles are 32 positions (3 stages at 8 warps), an fp8 cache's 64
    # query rows by 64 positions at 4 warps and 3 stages: the fastest of the H200's sweeps
    # over full prefill steps and chunks after a cached prefix.
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


@triton.jit(do_not_specialize=["num_rows"])  # see tiles.py' _NO_RESPECIALIZE
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
    FP8: tl.constexpr = False, FP8_ASM: tl.constexpr = False,
    V_T: tl.constexpr = False, FRESH: tl.constexpr = False,
):
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
    if FRESH:
        # the row's own positions from this step's K/V, then the cache's before them only
        # (their causal mask below always holds)
        acc, m_i, l_i = _prefill_fresh(
            q, acc, m_i, l_i, kn_ptr, vn_ptr, q_start, q_len, t0, tok, kv_head, offs_n,
            offs_d, scale_log2, stride_knt, stride_knh, stride_knd, stride_vnt, stride_vnh,
            stride_vnd, BLOCK_Q, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION)
        kv_end = prefix
        full_end = prefix // BLOCK_N * BLOCK_N
    if FP8_ASM:  # an fp8 cache is read into float16 (see _load_kv_tile)
        q = _to_f16(q)
    elif not FP8:  # or into the query's dtype
        q = q.to(k_cache_ptr.dtype.element_ty)
    for start in range(0, full_end, BLOCK_N):
        pos = start + offs_n
        k, k_scale, v, v_scale = _load_tiles(
            k_cache_ptr, v_cache_ptr, bt_row, start, offs_n, pos < kv_end, kv_end, kv_head,
            offs_d,
            stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh,
            stride_vd, BLOCK_SIZE, HEAD_DIM, BLOCK_D, False, FP8, q.dtype,
            q_ptr.dtype.element_ty, FP8_ASM, V_T, False)
        acc, m_i, l_i = _softmax_step(q, k, v, k_scale, v_scale, acc, m_i, l_i, None,
                                      scale_log2, False, FP8, DOT_PRECISION)
    # diagonal tiles: causal mask, and the context end (kv_end <= ctx) for the last one
    for start in range(full_end, kv_end, BLOCK_N):
        pos = start + offs_n
        valid = pos < kv_end
        k, k_scale, v, v_scale = _load_tiles(
            k_cache_ptr, v_cache_ptr, bt_row, start, offs_n, valid, kv_end, kv_head, offs_d,
            stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh,
            stride_vd, BLOCK_SIZE, HEAD_DIM, BLOCK_D, True, FP8, q.dtype,
            q_ptr.dtype.element_ty, FP8_ASM, V_T, False)
        allowed = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        acc, m_i, l_i = _softmax_step(q, k, v, k_scale, v_scale, acc, m_i, l_i, allowed,
                                      scale_log2, True, FP8, DOT_PRECISION)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_off[:, None] * stride_ot + heads[:, None] * stride_oh
             + offs_d[None, :] * stride_od, o.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dim_ok[None, :])


def launch_prefill(q, k_cache, v_cache, out, scale_log2: float, meta: AttentionMetadata,
                   cfg: TileConfig | None = None,
                   fresh: tuple[torch.Tensor, torch.Tensor] | None = None,
                   skip_decode: bool = False) -> None:
    """The attention of meta's rows of several query tokens into `out`
    (triton.attention.paged_attention's arguments; `skip_decode`: the decode kernel owns the
    rows of one token)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    num_rows = meta.context_lens.shape[0]
    group = num_q_heads // num_kv_heads
    flags = cache_flags(k_cache, v_cache, q)
    # an fp8 cache's tiles with `fresh` too (on the H200 a seed prefill step 0.236 ms against
    # 0.261 with a bf16 cache's, a chunk of 8 x 512 after 1,536 0.291 against 0.396)
    cfg = cfg or default_prefill_config(head_dim, meta.max_query_len, group, q.dtype,
                                        fp8=flags["FP8"])
    block_g = _pow2(group)
    if cfg.block_m % block_g or cfg.block_m < 16:
        raise ValueError(f"block_m={cfg.block_m} must be >= 16 and a multiple of {block_g}")
    block_q = cfg.block_m // block_g
    grid = (num_tokens // block_q + num_rows, num_kv_heads)
    if fresh is None:
        kn = vn = q  # unread
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
        SKIP_DECODE=skip_decode, DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **flags,
    )
