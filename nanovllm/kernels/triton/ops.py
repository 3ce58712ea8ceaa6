"""Fused Triton kernels for the small per-token ops of a decoder layer (the CUDA path).

In eager torch each of RMSNorm (with its casts), residual add + RMSNorm, Qwen3's per-head
q/k RMSNorm, RoPE and SiLU-and-mul is several elementwise kernels; here each is one. The
functions of torch_ops.py are the reference (and the CPU path); these match them op for op:
fp32 math where torch upcasts, and a rounding to the activation dtype wherever torch stores
an intermediate in that dtype, so fused and unfused runs agree to a few ulps of the dtype.

Launch grids depend only on tensor shapes, never on device values, so every op can sit
inside a captured CUDA graph. An engine picks these kernels through `kernels.select_kernels`
(fused_kernels on, the CUDA default); they accept tensors on any device, so tests call them
on CPU under TRITON_INTERPRET=1. Four small kernels share one file (~330 lines) and its
launch helpers (`_pow2`, `_warps`, `_rows`): each is one idea too small for a module.
"""

import torch
import triton
import triton.language as tl

from nanovllm.kernels.triton.launch import pdl_enter, pdl_launch
from nanovllm.kernels.triton.linear import SplitK


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


def _warps(elements: int, cap: int = 16) -> int:
    # ~8 elements per thread: 4 warps for a 1024-wide row, 16 for 4096 and wider
    return max(1, min(cap, elements // 256))


# ---------------------------------------------------------------------------------------
# RMSNorm, optionally after the residual add


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    res_out_ptr,
    w_ptr,
    out_ptr,
    stride_x,
    stride_r,
    stride_ro,
    stride_o,
    N,
    eps,
    stride_part,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PARTS: tl.constexpr = 0,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if PARTS > 0:  # x: a split-K projection's fp32 partials (linear.py), summed here
        for part in tl.static_range(1, PARTS):
            x += tl.load(x_ptr + part * stride_part + row * stride_x + cols, mask=mask, other=0.0)
        # rounded as the plain matmul rounds its output: to the activation (residual) dtype
        x = x.to(res_out_ptr.dtype.element_ty)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # the sum is rounded to the residual dtype before the norm reads it, as in torch
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    h = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(h * h, axis=0) / N + eps)
    y = (h * inv_rms).to(x.dtype)  # torch casts the normalized row back before the weight
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = y.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    # [..., N] as [rows, N] with unit column stride; a view whenever the layout allows it
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch_norm(x2, r2, ro2, weight, out2, eps, parts: torch.Tensor | None = None) -> None:
    # parts: [S, rows, n] fp32 partial sums whose total is x (x2 is then parts[0])
    rows, n = x2.shape
    if rows == 0:
        return
    block = _pow2(n)
    has_res = r2 is not None
    _rms_norm_kernel[(rows,)](
        x2,
        r2 if has_res else x2,
        ro2 if has_res else x2,
        weight,
        out2,
        x2.stride(0),
        r2.stride(0) if has_res else 0,
        ro2.stride(0) if has_res else 0,
        out2.stride(0),
        n,
        eps,
        parts.stride(0) if parts is not None else 0,
        HAS_RESIDUAL=has_res,
        BLOCK=block,
        PARTS=parts.shape[0] if parts is not None else 0,
        num_warps=_warps(block),
        **pdl_launch(x2),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim into a new tensor; same result as `torch_ops.rms_norm`."""
    n = x.shape[-1]
    assert weight.shape == (n,) and weight.is_contiguous()
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    _launch_norm(_rows(x), None, None, weight, out.view(-1, n), eps)
    return out


def add_rms_norm(
    x: torch.Tensor | SplitK, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual); same result as `torch_ops.add_rms_norm`.

    The sum is written IN PLACE into `residual` (and that tensor is returned) when it is
    contiguous and already has the sum's dtype; otherwise into a new tensor. The decoder
    (llama.py) may rely on this: its residual is a fresh tensor (the embedding output, then
    this function's own result) that nothing else reads once it is passed on, and updating
    it in place saves an allocation and a write of a new tensor per norm.

    `x` may be a split-K projection's partial products (triton.linear.SplitK): they are
    summed and rounded to their dtype, which must be the residual's, as the projection's
    plain matmul would have rounded its output.
    """
    parts = None
    if isinstance(x, SplitK):
        assert x.dtype == residual.dtype, "a SplitK is rounded to the residual's dtype"
        parts, x_dtype, x2 = x.parts, x.dtype, x.parts[0]
    else:
        x_dtype, x2 = x.dtype, _rows(x)
    n = x.shape[-1]
    assert residual.shape == x.shape, "no broadcasting of the residual"
    assert weight.shape == (n,) and weight.is_contiguous()
    res_dtype = torch.promote_types(x_dtype, residual.dtype)
    if residual.is_contiguous() and residual.dtype == res_dtype:
        new_residual = residual  # each element is read before the same program overwrites it
    else:
        new_residual = torch.empty(x.shape, dtype=res_dtype, device=residual.device)
    out = torch.empty(x.shape, dtype=torch.promote_types(res_dtype, weight.dtype),
                      device=residual.device)
    _launch_norm(x2, _rows(residual), new_residual.view(-1, n), weight, out.view(-1, n), eps,
                 parts)
    return out, new_residual


# ---------------------------------------------------------------------------------------
# q/k per-head RMSNorm (Qwen3) + neox RoPE, in place


@triton.jit
def _norm_rope_heads(
    ptr,
    stride_h,
    stride_d,
    w_ptr,
    cos,
    sin,
    eps,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    # all heads of one token: [heads, first half] and [heads, second half] of each head
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < NUM_HEADS) & (cols < HALF)
    p1 = ptr + heads * stride_h + cols * stride_d
    p2 = p1 + HALF * stride_d
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p2, mask=mask, other=0.0)
    dtype = x1.dtype
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    if HAS_NORM:
        sq = tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)
        inv_rms = tl.rsqrt(sq / (2 * HALF) + eps)[:, None]
        w1 = tl.load(w_ptr + cols, mask=cols < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + cols, mask=cols < HALF, other=0.0).to(tl.float32)
        # torch: weight * normalized.to(dtype), stored in dtype before RoPE reads it
        a = ((a * inv_rms).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        b = ((b * inv_rms).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    # each product and the sum rounded to dtype, as torch's x1 * cos - x2 * sin in dtype
    o1 = (a * cos).to(dtype).to(tl.float32) - (b * sin).to(dtype).to(tl.float32)
    o2 = (b * cos).to(dtype).to(tl.float32) + (a * sin).to(dtype).to(tl.float32)
    tl.store(p1, o1.to(dtype), mask=mask)
    tl.store(p2, o2.to(dtype), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr,
    k_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    qw_ptr,
    kw_ptr,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_cos,
    stride_sin,
    eps,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    # axis 1 picks q or k, so a decode step of a few tokens still runs two programs each
    qk_norm_rope_program(
        tl.program_id(0).to(tl.int64), tl.program_id(1), q_ptr, k_ptr, pos_ptr, cos_ptr,
        sin_ptr, qw_ptr, kw_ptr, stride_qt, stride_qh, stride_qd, stride_kt, stride_kh,
        stride_kd, stride_cos, stride_sin, eps, NUM_Q_HEADS, NUM_K_HEADS, HALF, BLOCK_QH,
        BLOCK_KH, BLOCK_HALF, HAS_NORM,
    )


@triton.jit
def qk_norm_rope_program(
    tok, which, q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd, stride_cos, stride_sin,
    eps, NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    """Token `tok`'s q heads (which == 0) or k heads (1), normalized and rotated in place
    (also the first half of kv_store.py's fused kernel)."""
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    # apply_rotary casts the fp32 table rows to the activation dtype before multiplying
    dtype = q_ptr.dtype.element_ty
    cos = tl.load(cos_ptr + pos * stride_cos + cols, mask=cols < HALF, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_sin + cols, mask=cols < HALF, other=0.0)
    cos = cos.to(dtype).to(tl.float32)
    sin = sin.to(dtype).to(tl.float32)
    if which == 0:
        _norm_rope_heads(
            q_ptr + tok * stride_qt,
            stride_qh,
            stride_qd,
            qw_ptr,
            cos,
            sin,
            eps,
            NUM_Q_HEADS,
            HALF,
            BLOCK_QH,
            BLOCK_HALF,
            HAS_NORM,
        )
    else:
        _norm_rope_heads(
            k_ptr + tok * stride_kt,
            stride_kh,
            stride_kd,
            kw_ptr,
            cos,
            sin,
            eps,
            NUM_K_HEADS,
            HALF,
            BLOCK_KH,
            BLOCK_HALF,
            HAS_NORM,
        )


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optional per-head RMSNorm (Qwen3's q_norm / k_norm) then neox RoPE, IN PLACE on q, k.

    q: [T, Hq, D], k: [T, Hkv, D], any strides (typically views into the qkv projection
    output, a token stride of q_size + 2 * kv_size); positions: [T] integers, each a row of
    the fp32 cos / sin tables [max_position, D / 2] (not bounds-checked). With weights
    (both or neither) the result equals `RMSNorm(q)` / `RMSNorm(k)` followed by
    `torch_ops.apply_rotary`, including its rounding of cos / sin and each product to q's
    dtype. Returns (q, k), the same tensors.
    """
    launch = rope_launch(q, k, positions, cos, sin, q_weight, k_weight, eps)
    if launch is not None:
        args, consts = launch
        _qk_norm_rope_kernel[(q.shape[0], 2)](*args, **consts)
    return q, k


def rope_launch(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
) -> tuple[list, dict] | None:
    """The checked arguments and constexprs (num_warps included) of a qk_norm_rope launch,
    shared by kv_store.py's fused kernel; None when there are no tokens."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    half = head_dim // 2
    assert k.shape == (num_tokens, num_k_heads, head_dim) and k.dtype == q.dtype
    assert positions.shape == (num_tokens,)
    assert head_dim % 2 == 0 and cos.shape[1] == half and sin.shape[1] == half
    assert cos.stride(1) == 1 and sin.stride(1) == 1
    has_norm = q_weight is not None
    assert (k_weight is not None) == has_norm, "q and k norm weights: both or neither"
    if has_norm:
        assert q_weight.shape == (head_dim,) and k_weight.shape == (head_dim,)
        assert q_weight.is_contiguous() and k_weight.is_contiguous()
    if num_tokens == 0:
        return None
    block_qh, block_kh, block_half = _pow2(num_q_heads), _pow2(num_k_heads), _pow2(half)
    args = [q, k, positions, cos, sin, q_weight if has_norm else q,
            k_weight if has_norm else k, *q.stride(), *k.stride(), cos.stride(0),
            sin.stride(0), eps]
    consts = dict(NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads, HALF=half,
                  BLOCK_QH=block_qh, BLOCK_KH=block_kh, BLOCK_HALF=block_half,
                  HAS_NORM=has_norm, num_warps=_warps(2 * block_qh * block_half, cap=8))
    return args, consts


# ---------------------------------------------------------------------------------------
# SiLU and mul


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, N, BLOCK: tl.constexpr,
                         PDL: tl.constexpr = False):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + N + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # torch rounds silu(gate) to the input dtype before the product
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    out = act * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [..., gate | up] of width 2 * I, into a new [..., I] tensor."""
    assert x.shape[-1] % 2 == 0
    n = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    x2 = _rows(x)
    if x2.shape[0] == 0 or n == 0:
        return out
    block = min(_pow2(n), 1024)  # several programs per row: a decode step has few rows
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](
        x2, out.view(-1, n), x2.stride(0), n, n, BLOCK=block, num_warps=_warps(block, cap=4),
        **pdl_launch(x2),
    )
    return out
