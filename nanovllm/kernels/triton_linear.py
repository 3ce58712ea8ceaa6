"""The projections back to the hidden size as a split-K GEMM, for steps of few rows (CUDA).

A decode step multiplies a few hundred rows. Projected to the hidden size (o_proj 2,048 ->
1,024 and down_proj 3,072 -> 1,024 in Qwen3-0.6B) that is a short, wide contraction with
few output tiles: cuBLAS ran these two at ~1 TB/s of weight reads on the H200, 5-7 us each
at any batch from 16 to 256 rows, while the other two projections of a layer read theirs at
2-3 TB/s (BENCHMARKS.md). Split along the contraction, S programs share each output tile
and the GPU fills up; each writes its fp32 partial product, and the residual-add RMSNorm
that always follows these projections (model/models/llama.py) adds the S slices up as it
reads its input (triton_ops.add_rms_norm), so the split costs no launch of its own.

`split_k_linear` returns a `SplitK` (the partials) or None where a split does not pay (more
rows than the table below, or a shape it does not divide): the caller then runs its plain
matmul. `small_linear` (prepared, off: SMALL_GEMMS) runs the same kernel unsplit for the
other two projections, qkv and gate_up, into their plain output. Only the Triton ops
understand a SplitK; kernels.select_kernels gives both functions to an engine only with them.
"""

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanovllm.kernels.triton_pdl import pdl_enter, pdl_launch

# rows -> (block_m, block_n, block_k, stages), from sweeps on the H200 at Qwen3-0.6B's two
# shapes, each tile timed with the norm that sums its partials (BENCHMARKS.md: 1.05-1.53x
# over cuBLAS and the norm); above the last row count, cuBLAS
TILES = ((16, (16, 64, 64, 4)), (128, (64, 64, 64, 4)), (256, (64, 128, 64, 3)))
MAX_SPLITS = 8
# Prepared, off (not measured yet): qkv_proj and gate_up_proj, which cuBLAS runs in a
# one-rank GPU step, at up to SMALL_TILES' last row count by a Triton launch into the
# activations' dtype, a programmatic dependent one (`small_linear`): it launches during the
# RMSNorm before it, and the RoPE + store or SiLU after it launches early behind it, where
# behind a cuBLAS kernel each starts cold. At 32 rows a layer's launches add up to ~51 us on
# the H200, 20 of them the projections (their weights' read time: 7.7), 13 the small
# latency-bound launches (BENCHMARKS.md, twentieth session); the tenth session's Triton
# projections at every row count, with slower tiles, ran 0.978x. "w-first"
# (`benchmarks/offline.py --small-gemms`): where a program's weight slice [SMALL_W_BLOCK_N,
# K] fits W_FIRST_BYTES and M is at most W_FIRST_ROWS, `_w_first_kernel` reads it before its
# PDL wait, so the weights stream from HBM while the norm before still runs, then takes the
# rows 16 at a time; else, and with "pipelined" (`--small-gemms-pipelined`), _split_k_kernel
# unsplit at SMALL_TILES. `benchmarks/blas.py --chain` times a layer's norm -> projection ->
# SiLU chains each way
SMALL_GEMMS: bool | str = False
# rows -> (block_m, block_n, block_k, stages) of small_linear, whole contraction a program
SMALL_TILES = ((16, (16, 32, 128, 4)), (64, (64, 32, 128, 3)))
SMALL_W_BLOCK_N = 16  # output columns of a w-first program (Qwen3-0.6B: 256 / 384 programs)
W_FIRST_BYTES = 32 * 1024  # its weight slice in registers: 64 a thread of 4 warps
# every w-first program reads all the rows (from the L2): 256 programs x 64 rows x 2 KB is
# 32 MB at qkv's shape, so above this many rows the pipelined kernel takes them
W_FIRST_ROWS = 64
# Prepared, off (not measured yet): split_k_linear (o_proj, down_proj) at up to W_FIRST_ROWS
# rows by _w_first_kernel too, each program's weight slice (a split's share of its columns)
# read before its PDL wait: o_proj's during the decode attention's last programs, down_proj's
# during the SiLU. `benchmarks/offline.py --w-first-split-k`
W_FIRST_SPLIT_K = False


@dataclass(frozen=True)
class SplitK:
    """A projection's output as S fp32 partial products `parts` [S, M, N], which its consumer
    sums and rounds to `dtype` (the activation dtype a plain matmul would have returned)."""

    parts: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.parts.shape[1:]

    def sum(self) -> torch.Tensor:
        return self.parts.sum(0).to(self.dtype)


@triton.jit
def _split_k_kernel(x_ptr, w_ptr, parts_ptr, M, N, K, k_len, stride_x, stride_w,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PRECISION: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    # program (m tile, n tile, split): x[m tile, split's k] @ w[n tile, split's k]^T -> parts
    pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = split * k_len + tl.arange(0, BLOCK_K)
    row_ok = offs_m[:, None] < M
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_x + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_w + offs_k[:, None]  # [K, N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for _ in range(0, k_len, BLOCK_K):  # the shapes divide exactly (split_k_linear checks)
        acc = tl.dot(tl.load(x_ptrs, mask=row_ok, other=0.0), tl.load(w_ptrs), acc,
                     input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out = parts_ptr + split.to(tl.int64) * M * N + offs_m[:, None] * N + offs_n[None, :]
    tl.store(out, acc, mask=row_ok)


@functools.lru_cache(maxsize=8)
def _sms(device: torch.device) -> int:
    # the decode attention's SM count (an H200's off the GPU); imported here, once a device,
    # as triton_decode imports triton_kv_store, then triton_ops, which imports this module
    from nanovllm.kernels.triton_decode import _num_sms

    return _num_sms(device)


def _shape(x: torch.Tensor, weight: torch.Tensor) -> tuple[int, int, int]:
    """(M, N, K) of x [M, K] @ weight [N, K]^T; a ValueError where x's width is not K."""
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"x of {x.shape[1]} columns for a weight of {weight.shape[1]} inputs")
    return x.shape[0], weight.shape[0], weight.shape[1]


def _precision(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _tile(x: torch.Tensor, weight: torch.Tensor, table, narrow_k: bool = False):
    """(m, n, k, tile) of x [M, K] @ weight [N, K]^T at the first tile of `table` (rows ->
    (block_m, block_n, block_k, stages)) taking M rows, or None where none does, there are
    no rows, a row is strided, or N and K do not divide into it (with `narrow_k`, block_k
    halves down to 16 until K does)."""
    m, n, k = _shape(x, weight)
    tile = next((t for rows, t in table if m <= rows), None)
    if tile is None or m == 0 or x.stride(1) != 1 or weight.stride(1) != 1:
        return None
    block_m, block_n, block_k, stages = tile
    while narrow_k and block_k > 16 and k % block_k:  # the tests' tiny models
        block_k //= 2
    if n % block_n or k % block_k:
        return None
    return m, n, k, (block_m, block_n, block_k, stages)


def _launch(x, weight, out, m, n, k, tile, splits: int) -> None:
    block_m, block_n, block_k, stages = tile
    _split_k_kernel[(triton.cdiv(m, block_m), n // block_n, splits)](
        x, weight, out, m, n, k, k // splits, x.stride(0), weight.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=_precision(x),
        num_warps=4, num_stages=stages, **pdl_launch(x))


@triton.jit
def _w_first_kernel(x_ptr, w_ptr, out_ptr, M, stride_x, stride_w, K_LEN: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                    PDL: tl.constexpr = False):
    # program (n tile, split): its weight slice w[n tile, split's K_LEN] read before the
    # wait (the weights are no kernel's output), then x @ slice^T for each tile of BLOCK_M
    # rows, into out (unsplit) or the split's partial product [M, N] of out
    pid_n, split = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = split * K_LEN + tl.arange(0, K_LEN)
    w = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * stride_w + offs_k[:, None])  # [K, N]
    pdl_enter(PDL)
    n_out = tl.num_programs(0) * BLOCK_N
    out_ptr += split.to(tl.int64) * M * n_out
    for m0 in range(0, M, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        row_ok = offs_m[:, None] < M
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_x + offs_k[None, :],
                    mask=row_ok, other=0.0)
        acc = tl.dot(x, w, input_precision=PRECISION)
        tl.store(out_ptr + offs_m[:, None] * n_out + offs_n[None, :], acc, mask=row_ok)


def _launch_w_first(x, weight, out, m, n, block_n: int, k_len: int) -> None:
    _w_first_kernel[(n // block_n, weight.shape[1] // k_len)](
        x, weight, out, m, x.stride(0), weight.stride(0), K_LEN=k_len, BLOCK_M=16,
        BLOCK_N=block_n, PRECISION=_precision(x), num_warps=4, num_stages=1,
        **pdl_launch(x))  # 1-4 row tiles: no pipelining


def _w_first_split(x: torch.Tensor, weight: torch.Tensor) -> SplitK | None:
    """split_k_linear by _w_first_kernel (W_FIRST_SPLIT_K), at the slice [block_n, k_len]
    (k_len a power of 2 dividing K) of W_FIRST_BYTES, or the largest under it, with programs
    for three quarters of the SMs or more, that moves the fewest extra bytes: the rows reread
    by each of N / block_n programs, the K / k_len fp32 partials written and summed. None
    above W_FIRST_ROWS rows, or where no slice divides the weight."""
    m, n, k = _shape(x, weight)
    if not 0 < m <= W_FIRST_ROWS or x.stride(1) != 1 or weight.stride(1) != 1:
        return None
    size = x.element_size()
    # (64 columns spilled registers compiled for sm_90 without PDL)
    slices = [(bn, kl) for bn in (32, 16) for kl in (1024, 512, 256, 128, 64, 32, 16)
              if n % bn == 0 and k % kl == 0 and bn * kl * size <= W_FIRST_BYTES]
    if not slices:
        return None
    sms, most = _sms(x.device), max(bn * kl for bn, kl in slices)
    full = [(bn, kl) for bn, kl in slices
            if bn * kl == most and (n // bn) * (k // kl) * 4 >= sms * 3]
    if not full:
        return None
    bn, kl = min(full, key=lambda s: (n // s[0]) * m * k * size + (k // s[1]) * m * n * 8)
    parts = torch.empty(k // kl, m, n, dtype=torch.float32, device=x.device)
    _launch_w_first(x, weight, parts, m, n, bn, kl)
    return SplitK(parts, x.dtype)


def split_k_linear(x: torch.Tensor, weight: torch.Tensor) -> SplitK | None:
    """x [M, K] @ weight [N, K]^T as S partial products, S chosen to fill the GPU's SMs; None
    where a split does not pay or the shapes do not divide into the tiles."""
    if W_FIRST_SPLIT_K and (parts := _w_first_split(x, weight)) is not None:
        return parts
    shapes = _tile(x, weight, TILES)
    if shapes is None:
        return None
    m, n, k, tile = shapes
    block_m, block_n, block_k, _ = tile
    tiles = triton.cdiv(m, block_m) * (n // block_n)
    splits = min(MAX_SPLITS, triton.next_power_of_2(max(1, _sms(x.device) // tiles + 1)) // 2)
    while splits > 1 and k % (splits * block_k):
        splits //= 2
    if splits < 2:  # enough tiles already: the plain matmul
        return None
    parts = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    _launch(x, weight, parts, m, n, k, tile, splits)
    return SplitK(parts, x.dtype)


def small_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x [M, K] @ weight [N, K]^T in x's dtype by one launch (SMALL_GEMMS: of _w_first_kernel
    where its slice fits, else of _split_k_kernel unsplit), for steps of few rows; None where
    the switch is off, M is above SMALL_TILES' last row count, or the shapes do not divide
    into its tile."""
    shapes = _tile(x, weight, SMALL_TILES, narrow_k=True) if SMALL_GEMMS else None
    if shapes is None:
        return None
    m, n, k, tile = shapes
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bn = SMALL_W_BLOCK_N
    if (SMALL_GEMMS == "w-first" and m <= W_FIRST_ROWS and n % bn == 0
            and k & (k - 1) == 0 and k >= 16
            and bn * k * x.element_size() <= W_FIRST_BYTES):
        _launch_w_first(x, weight, out, m, n, bn, k)
    else:
        _launch(x, weight, out, m, n, k, tile, 1)
    return out
