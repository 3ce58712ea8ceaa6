"""float32 -> float8 e4m3 in Triton, as the CUDA kernels round it: the fp8 cache's store
(`_store_fp8`, for triton_kv_store.py and triton_kv_runs.py). In Triton's CPU interpreter a
plain cast drops a mantissa's carry, so `_round_e4m3` rounds in float32 first."""

import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)  # the largest float8 e4m3 value


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
               HEAD_DIM: tl.constexpr, SCALED: tl.constexpr, PLANES: tl.constexpr):
    # the torch reference's quantize_fp8: float8 e4m3 bytes, then (SCALED) each head's
    # float32 scale amax / 448 at `scale_at` (head 0's; the 4 bytes after its values, or a
    # K cache's scale plane). In a cache stored
    # transposed (PLANES: an fp8 V cache, worker/kv_cache.py) those 4 bytes are stride_d
    # apart, each in its own row of the block
    # NaN stored as 0, +-inf as +-float32 max, as the reference does: the cache holds finite
    # bytes only, which the attention of a V cache stored transposed relies on
    x = x.to(tl.float32)
    x = tl.minimum(tl.maximum(tl.where(x == x, x, 0.0), -3.4028234663852886e38),
                   3.4028234663852886e38)
    if SCALED:
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
