"""Decode attention over an fp8 cache on the tensor cores' fp8 path: the engine's
`fp8_attention` ("q" or "qp"; off by default until the H200 has measured it).

`triton_decode._decode_kernel` converts every K and V byte to float16 in registers before
its dots (the GQA group's query heads, padded to 16, are the dots' M): per byte of cache that
is about twice the instructions of the bf16 kernel, and the fp8 decode reads at ~0.74 of
what its bytes allow on the H200 (BENCHMARKS.md). Here the operands are swapped, as
FlashAttention-3's and FlashInfer's GQA decode kernels do: the tile's positions are M,

    S^T [N, G] = K [N, D] @ q^T [D, G]        O^T [D, G] += V^T [D, N] @ P^T [N, G]

so K (rows of bytes, D contiguous) and V^T (the transposed V cache's rows, positions
contiguous) are the A operands straight from shared memory, and Triton compiles both dots
for sm_90 to `wgmma ... m64n16k32 .e4m3.e4m3` (tests/model/test_triton_ptx.py checks):
no conversion of the cache at all. The price is precision, on two sides:

- q is quantized to e4m3 with a scale per (token, head), amax / 448, as the cache stores K;
- P (`fp8_p`, mode "qp"): the probabilities times each position's V scale, divided by the
  tile's largest V scale so they lie in [0, 1], rounded to e4m3 (3 mantissa bits; below
  2^-6 subnormal, down to 2^-9). Mode "q": P and V^T go to the dot as float16 (V converted,
  as the engine's decode does), and only q is quantized.

`torch_attention.fp8_decode_reference` states those numerics in torch (the torch backend's
`fp8_attention`); the tests hold the kernel to it (CPU interpreter and CUDA) and both to
the fp32 attention within fp8's error. Same launch contract as `triton_decode`'s kernel:
one program per (row, kv head, split), the longest rows first given their order, partials
combined by its `_reduce_kernel`, rows whose query length is not 1 left alone. Supports
what the engine's fp8 cache is on a GPU: V transposed within blocks of a multiple of 128
tokens, head_dim a power of 2.
"""

import torch
import triton
import triton.language as tl

from nanovllm.kernels.attention_metadata import AttentionMetadata
from nanovllm.kernels.triton_decode import (
    _decode_out,
    _decode_program,
    _decode_span,
    _num_sms,
    choose_num_splits,
    reduce_splits,
    split_partials,
)
from nanovllm.kernels.triton_e4m3 import _rows_to_e4m3, _to_e4m3
from nanovllm.kernels.triton_kv_store import _fp8_flags
from nanovllm.kernels.triton_tiles import FP8_MMA_TILE, LOG2E, NEG_BIG, _tile_block

BLOCK_N = FP8_MMA_TILE  # positions a tile, as fp8_attention's prefill (one 128-token block)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_fp8_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    qsl_ptr, ctx_ptr, bt_ptr, order_ptr, scale_log2, num_splits,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt,
    NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    WRITE_OUT: tl.constexpr, SCALED: tl.constexpr, FP8_P: tl.constexpr, EXACT: tl.constexpr,
    LONGEST_FIRST: tl.constexpr, K_PLANE: tl.constexpr = False,
):
    row, kv_head, split = _decode_program(order_ptr, NUM_Q_HEADS // GROUP, LONGEST_FIRST)
    q_start, is_decode, ctx, tile_lo, tile_hi = _decode_span(qsl_ptr, ctx_ptr, row, split,
                                                             num_splits, BLOCK_N)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_g
    head_ok = offs_g < tl.where(is_decode, GROUP, 0)
    q = tl.load(q_ptr + q_start.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
                + offs_d[None, :] * stride_qd, mask=head_ok[:, None], other=0.0)
    # q to e4m3, a scale per head (as the cache stores K), transposed: the dot's B [D, G]
    q8, q_scale = _rows_to_e4m3(q, EXACT)
    qt = tl.trans(q8)
    col_scale = q_scale * scale_log2  # [G]: the score's factor from q's side

    m_i = tl.full([BLOCK_G], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([HEAD_DIM, BLOCK_G], tl.float32)  # O^T
    bt_row = bt_ptr + row.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        start = tile * BLOCK_N
        valid = start + offs_n < ctx
        k_at = _tile_block(k_cache_ptr, bt_row, start, kv_head, stride_kb, stride_ks,
                           stride_kh, BLOCK_SIZE, BLOCK_N)
        kb = k_at + offs_n * stride_ks  # [N] each position's row
        k8 = tl.load(kb[:, None] + offs_d[None, :] * stride_kd).to(tl.float8e4nv, bitcast=True)
        st = tl.dot(k8, qt)  # [N, G]
        if SCALED and K_PLANE:  # the block-head's plane of scales after its values
            first = tl.multiple_of(start % BLOCK_SIZE, BLOCK_N)
            plane = (k_at + (BLOCK_SIZE - first) * stride_ks).to(tl.pointer_type(tl.float32))
            k_scale = tl.load(plane + first + offs_n)
            s = st * k_scale[:, None] * col_scale[None, :]
        elif SCALED:  # each position's float32 scale, after its values
            k_scale = tl.load((kb + HEAD_DIM * stride_kd).to(tl.pointer_type(tl.float32)))
            s = st * k_scale[:, None] * col_scale[None, :]
        else:
            s = st * col_scale[None, :]
        # positions past the context lie in the tile's block: read, weighed 0 (their bytes
        # are finite: the store writes no NaN)
        s = tl.where(valid[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[None, :])  # [N, G]
        l_i = l_i * alpha + tl.sum(p, 0)
        # V^T [D, N]: the transposed cache's rows, the block's positions contiguous
        vb = _tile_block(v_cache_ptr, bt_row, start, kv_head, stride_vb, stride_vs, stride_vh,
                         BLOCK_SIZE, BLOCK_N) + offs_n * stride_vs
        vt8 = tl.load(vb[None, :] + offs_d[:, None] * stride_vd).to(tl.float8e4nv, bitcast=True)
        if SCALED:  # each position's scale: 4 bytes in rows HEAD_DIM .. + 3
            bits = tl.load(vb + HEAD_DIM * stride_vd).to(tl.int32)
            for j in tl.static_range(1, 4):
                bits = bits | (tl.load(vb + (HEAD_DIM + j) * stride_vd).to(tl.int32) << (8 * j))
            v_scale = tl.where(valid, bits.to(tl.float32, bitcast=True), 0.0)
        else:
            v_scale = tl.where(valid, 1.0, 0.0)
        if FP8_P:
            v_max = tl.maximum(tl.max(v_scale, 0), 1e-30)
            p8 = _to_e4m3(p * (v_scale / v_max)[:, None], EXACT)
            pv = tl.dot(vt8, p8) * v_max
        else:
            pv = tl.dot(vt8.to(tl.float16), (p * v_scale[:, None]).to(tl.float16))
        acc = acc * alpha[None, :] + pv
        m_i = m_new

    _decode_out(tl.trans(acc), m_i, l_i, out_ptr, part_o_ptr, part_lse_ptr, row, split,
                num_splits, q_start, heads, head_ok, offs_d < HEAD_DIM, offs_d, stride_ot,
                stride_oh, stride_od, NUM_Q_HEADS, HEAD_DIM, WRITE_OUT)


def decode_fp8(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float, *, fp8_p: bool = True,
               num_splits: int | None = None, out: torch.Tensor | None = None,
               order: torch.Tensor | None = None, num_warps: int = 4,
               num_stages: int = 3) -> torch.Tensor:
    """Decode attention ([T, Hq, D] -> [T, Hq, D]) of the rows with one query token over an
    fp8 cache with V transposed, in the numerics of `torch_attention.fp8_decode_reference`,
    into `out` (default: zeros); other rows' output is left as it was. `order`: the rows,
    longest context first, whose programs then start first (triton_attention's
    `longest_first`)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_rows, num_kv_heads = meta.context_lens.shape[0], k_cache.shape[2]
    flags = _fp8_flags(k_cache, v_cache, head_dim)
    if not (flags["FP8"] and flags["V_T"]) or k_cache.shape[1] % BLOCK_N:
        raise ValueError("decode_fp8 needs an fp8 cache with V transposed, in blocks of "
                         f"a multiple of {BLOCK_N} tokens")
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"decode_fp8 needs a power-of-2 head_dim, not {head_dim}")
    if out is None:
        out = torch.zeros((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_rows == 0:
        return out
    group = num_q_heads // num_kv_heads
    if num_splits is None:
        num_splits = choose_num_splits(num_rows, num_kv_heads, meta.max_context_len,
                                       _num_sms(q.device))
    part_o, part_lse = split_partials(out, num_rows, num_splits)
    grid = ((num_rows, num_kv_heads, num_splits) if order is None
            else (num_kv_heads * num_splits, num_rows))
    _decode_fp8_kernel[grid](
        q, k_cache, v_cache, out, part_o, part_lse, meta.query_start_loc, meta.context_lens,
        meta.block_tables, meta.context_lens if order is None else order, scale * LOG2E,
        num_splits,
        *q.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride(),
        meta.block_tables.stride(0),
        NUM_Q_HEADS=num_q_heads, GROUP=group, BLOCK_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=BLOCK_N,
        WRITE_OUT=num_splits == 1, SCALED=flags["SCALED"], FP8_P=fp8_p,
        EXACT=not q.is_cuda, LONGEST_FIRST=order is not None, K_PLANE=flags["K_PLANE"],
        num_warps=num_warps, num_stages=num_stages,
    )
    reduce_splits(part_o, part_lse, out, meta.query_start_loc, num_rows, num_splits)
    return out
