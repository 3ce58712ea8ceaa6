"""float32 -> float8 e4m3 in Triton, as the CUDA kernels round it: the fp8 cache's store
(triton_kv_store.py) and `fp8_attention`'s q and P (triton_attention.py,
triton_fp8_decode.py). In Triton's CPU interpreter a plain cast drops a mantissa's carry, so
`_round_e4m3` rounds in float32 first where the result must be exact."""

import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)  # the largest float8 e4m3 value


@triton.jit
def _to_e4m3(x, EXACT: tl.constexpr):
    # x (float32, |x| <= 448) as float8 e4m3, rounded to nearest even (fp8_attention's q and
    # P). EXACT: round in float32 first (the interpreter's own cast drops a mantissa's
    # carry); a GPU's cvt.rn.satfinite does it in one instruction
    if EXACT:
        x = _round_e4m3(x)
    return x.to(tl.float8e4nv)


@triton.jit
def _rows_to_e4m3(x, EXACT: tl.constexpr):
    # rows of x [R, D] -> (e4m3 [R, D], each row's float32 scale amax / 448 [R]): fp8_attention's
    # q, a scale per token and head as the cache's K has
    x = x.to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 1), 1e-12) / FP8_MAX
    return _to_e4m3(x / scale[:, None], EXACT), scale


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
