"""The projections back to the hidden size as a split-K GEMM, for steps of few rows (CUDA).

A decode step multiplies a few hundred rows. Projected to the hidden size (o_proj 2,048 ->
1,024 and down_proj 3,072 -> 1,024 in Qwen3-0.6B) that is a short, wide contraction with
few output tiles, which cuBLAS runs at a fraction of the weight-read bandwidth the other two
projections of a layer reach. Split along the contraction, S programs share each output tile
and the GPU fills up; each writes its fp32 partial product, and the residual-add RMSNorm
that always follows these projections (model/models/llama.py) adds the S slices up as it
reads its input (triton.ops.add_rms_norm), so the split costs no launch of its own.

`split_k_linear` returns a `SplitK` (the partials) or None where a split does not pay (more
rows than the table below, or a shape it does not divide): the caller then runs its plain
matmul. `small_linear` runs the same kernel unsplit for the other two
projections, qkv and gate_up, at up to 64 rows, into their plain output. Only the Triton ops
understand a SplitK; kernels.select_kernels gives both functions to an engine only with them.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanovllm.kernels.triton.launch import num_sms, pdl_enter, pdl_launch

# rows -> (block_m, block_n, block_k, stages), from sweeps on the H200 at Qwen3-0.6B's two
# shapes, each tile timed with the norm that sums its partials; above the last row count,
# cuBLAS
TILES = ((16, (16, 64, 64, 4)), (128, (64, 64, 64, 4)), (256, (64, 128, 64, 3)))
MAX_SPLITS = 8
# qkv_proj and gate_up_proj at up to SMALL_TILES' last row count run _split_k_kernel
# unsplit into the activations' dtype (`small_linear`) as a programmatic dependent launch:
# it launches during the RMSNorm before it, and the RoPE + store or SiLU after it launches
# early behind it, where behind a cuBLAS kernel each starts cold. rows -> (block_m, block_n,
# block_k, stages), whole contraction a program
SMALL_TILES = ((16, (16, 32, 128, 4)), (64, (64, 32, 128, 3)))
# the longest contraction it takes: measured at Qwen3-0.6B's 1,024 only; a program reads its
# columns' whole contraction, so a larger model's (8B: 4,096) keeps cuBLAS until measured
SMALL_MAX_K = 1024


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


def _tile(x: torch.Tensor, weight: torch.Tensor, table, narrow_k: bool = False):
    """(m, n, k, tile) of x [M, K] @ weight [N, K]^T at the first tile of `table` (rows ->
    (block_m, block_n, block_k, stages)) taking M rows, or None where none does, there are
    no rows, a row is strided, or N and K do not divide into it (with `narrow_k`, block_k
    halves down to 16 until K does)."""
    m, k = x.shape[0], weight.shape[1]
    if x.shape[1] != k:
        raise ValueError(f"x of {x.shape[1]} columns for a weight of {k} inputs")
    n = weight.shape[0]
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
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=stages, **pdl_launch(x))


def split_k_linear(x: torch.Tensor, weight: torch.Tensor) -> SplitK | None:
    """x [M, K] @ weight [N, K]^T as S partial products, S chosen to fill the GPU's SMs; None
    where a split does not pay or the shapes do not divide into the tiles."""
    shapes = _tile(x, weight, TILES)
    if shapes is None:
        return None
    m, n, k, tile = shapes
    block_m, block_n, block_k, _ = tile
    tiles = triton.cdiv(m, block_m) * (n // block_n)
    splits = min(MAX_SPLITS, triton.next_power_of_2(max(1, num_sms(x.device) // tiles + 1)) // 2)
    while splits > 1 and k % (splits * block_k):
        splits //= 2
    if splits < 2:  # enough tiles already: the plain matmul
        return None
    parts = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    _launch(x, weight, parts, m, n, k, tile, splits)
    return SplitK(parts, x.dtype)


def small_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x [M, K] @ weight [N, K]^T in x's dtype by one launch of _split_k_kernel unsplit, for
    steps of few rows; None where M is above SMALL_TILES' last row count, K above
    SMALL_MAX_K, or the shapes do not divide into its tile."""
    if weight.shape[1] > SMALL_MAX_K:
        return None
    shapes = _tile(x, weight, SMALL_TILES, narrow_k=True)
    if shapes is None:
        return None
    m, n, k, tile = shapes
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _launch(x, weight, out, m, n, k, tile, 1)
    return out
