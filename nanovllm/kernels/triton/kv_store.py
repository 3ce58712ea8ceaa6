"""Writing K/V into the paged cache in Triton (`store_kv`), the CUDA backend's counterpart of
`torch_attention.store_kv`: the same bytes, for the model's dtype and for an fp8 cache
(float8 e4m3 values, then each token-head's float32 scale when the cache is that wide).
attention.py reads what this writes and re-exports `store_kv`, so the backend is one module
to the model (kernels/__init__.py).

`qk_norm_rope_store` is ops.qk_norm_rope and `store_kv` in one launch, the one a
decoder layer makes when both its ops and its attention are Triton's: a launch less per
layer, ~1.5-1.8 us of a decode step's GPU time each on an H200."""

import torch
import triton
import triton.language as tl

from nanovllm.kernels.triton.launch import pdl_enter, pdl_launch
from nanovllm.kernels.triton.ops import qk_norm_rope, qk_norm_rope_program, rope_launch
from nanovllm.kernels.triton.tiles import cache_flags

# The fused RoPE + store of up to this many tokens (a decode step's) into a V cache stored
# transposed stores each token's V from a program of its own, beside the ones rotating q
# and k, so the V's byte writes do not wait on the RoPE; a larger launch (a prefill step's)
# is faster with the V after the K in the same program.
V_APART_MAX_TOKENS = 1024
FP8_MAX = tl.constexpr(448.0)  # the largest float8 e4m3 value
# a transposed fp8 V is written RUN positions at a time where a launch stores RUN tokens at
# consecutive slots from a multiple of RUN (a prefill chunk's), all in one block of one
# sequence: each row of the run's V takes its RUN bytes in one store instead of one byte
# from each token's program. Every token of a run decides the same from the run's slots
# (`_complete_run`), so the host does nothing for it.
RUN = tl.constexpr(16)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
    V_T: tl.constexpr = False, PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    _store_token(
        tl.program_id(0), k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
        stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
        stride_kcb, stride_kcs, stride_kch, stride_kcd,
        stride_vcb, stride_vcs, stride_vch, stride_vcd,
        NUM_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_H, BLOCK_D, FP8, V_T,
    )


@triton.jit
def _store_token(
    tok, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
    V_T: tl.constexpr, PART: tl.constexpr = 0,
):
    # token `tok`'s K/V [heads, head_dim] into its slot (-1: none); PART 1: its K only, 2:
    # its V only (the fused kernel's programs apart), 0: both. Beside a transposed V (V_T) an
    # fp8 K keeps each block-head's scales in a plane after its values
    # (torch_attention.k_scale_plane); a transposed V is written by runs (kv_store.py)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    # clamp so a skipped (-1) slot never forms an address before the cache, even masked
    safe = tl.maximum(slot, 0)
    blk = safe // BLOCK_SIZE
    off = safe % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # the skip folded into the head bound (a `& scalar_bool` mask trips the interpreter)
    mask = (offs_h[:, None] < tl.where(slot >= 0, NUM_HEADS, 0)) & (offs_d[None, :] < HEAD_DIM)
    head_mask = offs_h < tl.where(slot >= 0, NUM_HEADS, 0)
    src = tok.to(tl.int64)
    if PART != 2:
        k = tl.load(k_ptr + src * stride_kt + offs_h[:, None] * stride_kh
                    + offs_d[None, :] * stride_kd, mask=mask)
        kc = k_cache_ptr + blk * stride_kcb + off * stride_kcs
        if FP8:
            if V_T:  # the block-head's plane of scales
                k_scale_at = k_cache_ptr + blk * stride_kcb + BLOCK_SIZE * stride_kcs + 4 * off
            else:
                k_scale_at = kc + HEAD_DIM * stride_kcd
            _store_fp8(kc, k_scale_at, k, mask, head_mask, offs_h, offs_d, stride_kch,
                       stride_kcd, HEAD_DIM, False)
        else:
            tl.store(kc + offs_h[:, None] * stride_kch + offs_d[None, :] * stride_kcd,
                     k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    if PART != 1:
        v_at = v_ptr + src * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd
        # in a launch's store of many tokens into a transposed V (not a decode step's V program,
        # PART 2, whose load goes beside its slots' rather than a step after them), a token
        # reads its V only where it stores it; otherwise every token reads its V at once
        late: tl.constexpr = PART != 2 and FP8 and V_T
        if not late:
            v = tl.load(v_at, mask=mask)
        vc = v_cache_ptr + blk * stride_vcb + off * stride_vcs
        if FP8:
            if V_T:
                # a complete run's V is written 16 bytes a row, head h by the program of the
                # run's (h mod RUN)-th token; a token outside one writes its own
                lead, complete = _complete_run(slot_ptr, tok, slot, tl.num_programs(0))
                if complete & (tok - lead < NUM_HEADS):
                    first = tl.multiple_of(off - off % RUN, RUN)  # said: the stores vectorize
                    run_at = v_cache_ptr + blk * stride_vcb + first * stride_vcs
                    _store_v_run(v_ptr, lead, stride_vt, stride_vh, stride_vd, run_at,
                                 stride_vch, stride_vcd, tok - lead, NUM_HEADS, HEAD_DIM,
                                 BLOCK_D)
                heads = tl.where((slot >= 0) & (complete == 0), NUM_HEADS, 0)
                v_mask = (offs_h[:, None] < heads) & (offs_d[None, :] < HEAD_DIM)
                if late:
                    v = tl.load(v_at, mask=v_mask)
                _store_fp8(vc, vc + HEAD_DIM * stride_vcd, v, v_mask, offs_h < heads, offs_h,
                           offs_d, stride_vch, stride_vcd, HEAD_DIM, V_T)
            else:
                _store_fp8(vc, vc + HEAD_DIM * stride_vcd, v, mask, head_mask, offs_h, offs_d,
                           stride_vch, stride_vcd, HEAD_DIM, V_T)
        else:
            tl.store(vc + offs_h[:, None] * stride_vch + offs_d[None, :] * stride_vcd,
                     v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_store_kernel(
    q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd, stride_cos, stride_sin,
    eps,
    v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
    V_T: tl.constexpr = False, PDL: tl.constexpr = False, V_APART: tl.constexpr = False,
):
    pdl_enter(PDL)
    # program (token, 0) rotates the token's q heads; (token, 1) its k heads, then stores the
    # rotated K into the cache; with V_APART, (token, 2) stores its V meanwhile, else
    # (token, 1) does after its K
    tok, which = tl.program_id(0).to(tl.int64), tl.program_id(1)
    if which < 2:
        qk_norm_rope_program(
            tok, which, q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr,
            stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd, stride_cos,
            stride_sin, eps, NUM_Q_HEADS, NUM_K_HEADS, HALF, BLOCK_QH, BLOCK_KH, BLOCK_HALF,
            HAS_NORM,
        )
    # the store: (token, 1) after its K's rotation (a barrier: every thread of the program
    # wrote it), K alone with V_APART, (token, 2) the V meanwhile; one call site, unrolled
    for part in tl.static_range(1, 3 if V_APART else 2):
        if which == part:
            if part == 1:
                tl.debug_barrier()
            _store_token(
                tok, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
                stride_kcb, stride_kcs, stride_kch, stride_kcd,
                stride_vcb, stride_vcs, stride_vch, stride_vcd,
                NUM_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_H, BLOCK_D, FP8, V_T,
                part if V_APART else 0,
            )


def qk_norm_rope_store(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None, eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`qk_norm_rope(q, k, ...)` (in place), then `store_kv(k, v, k_cache, v_cache,
    slot_mapping)`, in one launch: the same bytes in q, k and the cache. Before the cache
    is allocated (empty), the RoPE alone. Returns (q, k)."""
    if k_cache.numel() == 0:
        return qk_norm_rope(q, k, positions, cos, sin, q_weight, k_weight, eps)
    launch = rope_launch(q, k, positions, cos, sin, q_weight, k_weight, eps)
    if launch is None:
        return q, k
    assert v.shape == k.shape
    args, consts = launch
    store = _store_consts(k, k_cache, v_cache)
    apart = v_apart(q.shape[0], store["V_T"])
    _rope_store_kernel[(q.shape[0], 3 if apart else 2)](
        *args, v, k_cache, v_cache, slot_mapping,
        *v.stride(), *k_cache.stride(), *v_cache.stride(),
        **consts, **store, **pdl_launch(k), V_APART=apart,
    )
    return q, k


def v_apart(num_tokens: int, v_t: bool) -> bool:
    """Whether qk_norm_rope_store stores a launch's V from programs of their own: by its
    number of tokens (V_APART_MAX_TOKENS), so a captured graph replays the same grid, over a V cache
    stored transposed (`v_t`, the store's V_T flag: an fp8 one; a bf16 decode step's store
    measured 2.7 us apart against 2.4)."""
    return num_tokens <= V_APART_MAX_TOKENS and v_t


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's K/V ([T, Hkv, D]) into its cache slot; slot -1 skips the token.

    Grid: (T,), from the shape only, so it can sit inside a captured CUDA graph.
    """
    num_tokens = k.shape[0]
    if num_tokens == 0 or k_cache.numel() == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        **_store_consts(k, k_cache, v_cache), **pdl_launch(k),
    )


def _store_consts(k: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> dict:
    _, num_heads, head_dim = k.shape
    flags = cache_flags(k_cache, v_cache)
    return dict(NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
                BLOCK_H=triton.next_power_of_2(num_heads),
                BLOCK_D=triton.next_power_of_2(head_dim), **flags)


# ---- float32 -> e4m3 bytes as the CUDA kernels round them (in Triton's CPU interpreter a
# plain cast drops a mantissa's carry, so _round_e4m3 rounds in float32 first)

@triton.jit
def _round_e4m3(x):
    # x (float32, |x| <= 448) rounded to the nearest float8 e4m3 value, ties to even, in
    # float32 arithmetic, so the cast after it is exact: the interpreter's own cast loses
    # the carry of a mantissa that rounds up (1.97 -> 1.0); a GPU's cast would agree
    bits = x.to(tl.int32, bitcast=True)
    exp = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # e4m3: subnormal below 2^-6
    step = ((exp - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
    magic = 12582912.0  # 1.5 * 2^23: adding and subtracting it rounds to an integer, RNE
    r = ((tl.abs(x) / step + magic) - magic) * step
    return tl.where(bits < 0, -r, r)


@triton.jit
def _store_fp8(cache, scale_at, x, mask, head_mask, offs_h, offs_d, stride_h, stride_d,
               HEAD_DIM: tl.constexpr, PLANES: tl.constexpr):
    # the torch reference's quantize_fp8: float8 e4m3 bytes, then each head's
    # float32 scale amax / 448 at `scale_at` (head 0's; the 4 bytes after its values, or a
    # K cache's scale plane). In a cache stored
    # transposed (PLANES: an fp8 V cache, worker/kv_cache.py) those 4 bytes are stride_d
    # apart, each in its own row of the block
    # NaN stored as 0, +-inf as +-float32 max, as the reference does: the cache holds finite
    # bytes only, which the attention of a V cache stored transposed relies on
    x = x.to(tl.float32)
    x = tl.minimum(tl.maximum(tl.where(x == x, x, 0.0), -3.4028234663852886e38),
                   3.4028234663852886e38)
    scale = tl.maximum(tl.max(tl.abs(tl.where(mask, x, 0.0)), 1), 1e-12) / FP8_MAX
    x = x / scale[:, None]
    if PLANES:
        bits = scale.to(tl.int32, bitcast=True)
        for j in tl.static_range(4):
            tl.store(cache + offs_h * stride_h + (HEAD_DIM + j) * stride_d,
                     ((bits >> (8 * j)) & 0xFF).to(tl.uint8), mask=head_mask)
    else:
        scale_ptr = (scale_at + offs_h * stride_h).to(tl.pointer_type(tl.float32))
        tl.store(scale_ptr, scale, mask=head_mask)
    x = _round_e4m3(tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX))
    tl.store(cache + offs_h[:, None] * stride_h + offs_d[None, :] * stride_d,
             x.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=mask)


# ---- a transposed V by runs (RUN)

@triton.jit
def _complete_run(slot_ptr, tok, slot, num_tokens):
    # -> (the token that leads token `tok`'s run, whether that run is complete: RUN tokens
    # of this launch, from the lead on, at consecutive slots from a multiple of RUN, so all
    # in one block and one sequence). Every token of a run computes the same answer
    safe = tl.maximum(slot, 0)
    lead = tok - safe % RUN
    offs = tl.arange(0, RUN)
    idx = lead + offs
    inside = (idx >= 0) & (idx < num_tokens)
    slots = tl.load(slot_ptr + tl.where(inside, idx, 0), mask=inside, other=-1)
    same = (slots == (safe - safe % RUN) + offs) & inside
    complete = (tl.sum(same.to(tl.int32), 0) == RUN) & (slot >= 0)
    return lead, complete


@triton.jit
def _store_v_run(v_ptr, lead, stride_vt, stride_vh, stride_vd, run_at, stride_h, stride_d,
                 mine, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    # the V of RUN tokens from `lead` into a transposed cache at `run_at` (their first
    # position), heads mine, mine + RUN, ...: per head, _store_fp8 with the run's positions
    # as its rows, a byte apart, so each of a head's rows takes the run's RUN bytes in one store
    for h in range(mine, NUM_HEADS, RUN):
        _store_v_run_head(v_ptr, lead, stride_vt, stride_vh, stride_vd, run_at, stride_h,
                          stride_d, h, HEAD_DIM, BLOCK_D)


@triton.jit
def _store_v_run_head(v_ptr, lead, stride_vt, stride_vh, stride_vd, run_at, stride_h,
                      stride_d, h, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_t = tl.arange(0, RUN)
    offs_d = tl.arange(0, BLOCK_D)
    dim_ok = offs_d[None, :] < HEAD_DIM
    rows = (lead + offs_t).to(tl.int64)
    x = tl.load(v_ptr + rows[:, None] * stride_vt + h * stride_vh + offs_d[None, :] * stride_vd,
                mask=dim_ok, other=0.0)  # [RUN, D]
    head_at = run_at + h * stride_h
    _store_fp8(head_at, head_at, x, dim_ok, offs_t < RUN, offs_t, offs_d, 1, stride_d,
               HEAD_DIM, True)
