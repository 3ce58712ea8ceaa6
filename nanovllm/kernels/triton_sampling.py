"""One-pass sampling kernel for the common batch: greedy and plain-temperature rows, by a
Gumbel race. The engine samples these rows by their inverse CDF instead
(triton_cdf_sampling.py, 2.5x faster at 256 rows); this is its switch's other side
(`triton_cdf_sampling.INVERSE_CDF` off, `offline.py --gumbel-sampler`).

The torch sampler draws an exponential race over a float32 copy of the logits: seven or
eight full passes over a [rows, vocab] tensor (cast, rand, clamp, divide, two logs,
subtract, argmax), ~0.5 ms per step at 256 rows of a 152k vocabulary on an H200. This
kernel reads each row of logits once, in their own dtype, and keeps a running
argmax of `logits / T + Gumbel noise` (plain `logits` when T == 0), which picks token i
with probability softmax(logits / T)_i (the Gumbel-max trick: the same race as the torch
path, in log space).

Top-k/top-p/min-p and seeded rows keep the torch path (`sampler.sample` decides); the
noise here comes from Triton's Philox generator keyed by a per-call seed, so unseeded
draws differ from the torch path's but have the same distribution. Ties go to the lowest
token id, as `torch.argmax` does, so greedy rows give identical tokens.

The noise is what costs: the kernel is bound by arithmetic, not by reading the logits. One
Philox call gives four tokens their uniforms and the logarithms are the GPU's approximate
lg2 (FAST_LOG), so 256 rows at T = 0.6 take ~80 us on an H200, against 230 us with a
Philox call and two polynomial logarithms per token (`python -m benchmarks.sampler`).
"""

import random

import torch
import triton
import triton.language as tl

_rng = random.Random()
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit(do_not_specialize=["seed"])  # a fresh seed per call must not pick a variant
def _gumbel_argmax_kernel(
    logits_ptr, stride_row, temps_ptr, best_ptr, best_idx_ptr, seed, vocab_size, split_len,
    min_temperature, BLOCK: tl.constexpr, FAST_LOG: tl.constexpr = False,
):
    # one program per (row, vocabulary split): the split's best value and its token id
    row, split = tl.program_id(0), tl.program_id(1)
    num_splits = tl.num_programs(1)
    temp = tl.load(temps_ptr + row).to(tl.float32)
    Q: tl.constexpr = BLOCK // 4  # a tile is four quarters, one per Philox output
    lanes = tl.arange(0, Q)
    best = tl.full([Q], float("-inf"), tl.float32)
    best_idx = tl.full([Q], 2147483647, tl.int32)
    base = logits_ptr + row.to(tl.int64) * stride_row
    lo = split * split_len
    hi = tl.minimum(lo + split_len, vocab_size)
    if temp == 0.0:  # greedy: the plain argmax, a tile's quarters loaded together
        for start in range(lo, hi, BLOCK):
            x0, m0 = _tile_quarter(base, start + lanes, hi)
            x1, m1 = _tile_quarter(base, start + Q + lanes, hi)
            x2, m2 = _tile_quarter(base, start + 2 * Q + lanes, hi)
            x3, m3 = _tile_quarter(base, start + 3 * Q + lanes, hi)
            best, best_idx = _race(best, best_idx, x0, start + lanes, m0)
            best, best_idx = _race(best, best_idx, x1, start + Q + lanes, m1)
            best, best_idx = _race(best, best_idx, x2, start + 2 * Q + lanes, m2)
            best, best_idx = _race(best, best_idx, x3, start + 3 * Q + lanes, m3)
    else:
        # the race in base 2: x * log2(e) / T - log2(-log2(u)) is log2(e) times the natural
        # one, x / T - log(-log(u)), plus a constant, so the same token wins
        scale = LOG2E / tl.maximum(temp, min_temperature)
        tiles = tl.cdiv(vocab_size, BLOCK)
        for start in range(lo, hi, BLOCK):
            # one Philox call gives four uniforms: token start + j * Q + i takes the j-th of
            # counter i, so the noise is keyed by the absolute token id, not by the split
            u0, u1, u2, u3 = tl.rand4x(seed, (row * tiles + start // BLOCK) * Q + lanes)
            best, best_idx = _noisy_race(best, best_idx, base, start + lanes, hi, scale, u0,
                                         FAST_LOG)
            best, best_idx = _noisy_race(best, best_idx, base, start + Q + lanes, hi, scale,
                                         u1, FAST_LOG)
            best, best_idx = _noisy_race(best, best_idx, base, start + 2 * Q + lanes, hi,
                                         scale, u2, FAST_LOG)
            best, best_idx = _noisy_race(best, best_idx, base, start + 3 * Q + lanes, hi,
                                         scale, u3, FAST_LOG)
    top = tl.max(best, axis=0)
    # lowest id among lanes holding the maximum (argmax's tie rule)
    idx = tl.min(tl.where(best == top, best_idx, 2147483647), axis=0)
    idx = tl.where(idx == 2147483647, lo, idx)  # an all -inf split: its first id
    tl.store(best_ptr + row * num_splits + split, top)
    tl.store(best_idx_ptr + row * num_splits + split, idx.to(tl.int64))


@triton.jit
def _race(best, best_idx, x, offs, mask):
    take = (x > best) | ((x == best) & mask & (offs < best_idx))
    return tl.where(take, x, best), tl.where(take, offs, best_idx)


@triton.jit
def _tile_quarter(base, offs, hi):
    mask = offs < hi
    return tl.load(base + offs, mask=mask, other=float("-inf")).to(tl.float32), mask


@triton.jit
def _noisy_race(best, best_idx, base, offs, hi, scale, u, FAST_LOG: tl.constexpr):
    x, mask = _tile_quarter(base, offs, hi)
    # u == 0 gives -inf noise: that token simply loses the race (never NaN)
    noise = -_log2(neg_log2_uniform(u, FAST_LOG), FAST_LOG)
    x = tl.where(mask, x * scale + noise, float("-inf"))
    return _race(best, best_idx, x, offs, mask)


@triton.jit
def neg_log2_uniform(u, FAST: tl.constexpr):
    """-log2(u) for u in [0, 1) (Triton's uniforms stop at 1 - 2^-24): > 0, inf at 0.

    Close to 1 the value is tiny, and the approximate lg2's absolute error (2^-22 on
    [0.5, 2]) is larger than it: -lg2(u) could come out 0, making the noise +inf, a sure
    win for a token of any probability (~2^-22 of the draws, a few percent of 152k-token
    rows), or negative (NaN noise). There the series -log2(1 - v) = v log2(e) (1 + v/2 +
    v^2/3 ...) is used instead, exact to float precision for v = 1 - u < 2^-10 (v itself is
    exact: u >= 0.5)."""
    v = 1.0 - u
    series = v * (LOG2E * (1.0 + 0.5 * v))
    return tl.where(v < 0.0009765625, series, -_log2(u, FAST))


@triton.jit
def _log2(x, FAST: tl.constexpr):
    # FAST (CUDA): the hardware's approximate log2, one special-function instruction in
    # place of tl.log2's polynomial (0 -> -inf, inf -> inf, as tl.log2; absolute error 2^-22
    # on [0.5, 2], 2 ulp elsewhere: see neg_log2_uniform for what that means near 1)
    if FAST:
        return tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [x],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.log2(x)


def gumbel_argmax(
    logits: torch.Tensor, temperatures: torch.Tensor, min_temperature: float,
    seed: int | None = None, num_splits: int | None = None,
) -> torch.Tensor:
    """Token ids [B] (int64): argmax for rows with temperature 0, otherwise a draw from
    softmax(logits / max(T, min_temperature)). `logits` [B, V] in any float dtype, rows
    contiguous; no host sync. Each row's vocabulary is split over several programs so a
    small batch still fills the GPU; the splits' winners are reduced by argmax (first
    split wins a tie, so the lowest id does)."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1, "logits rows must be contiguous"
    if rows == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    if seed is None:
        seed = _rng.getrandbits(31)
    block = max(64, min(2048, triton.next_power_of_2(vocab)))  # quarters of >= 16 lanes
    if num_splits is None:  # about 2048 programs in all (16 per SM on an H200; at 256 and
        # 512 rows of a 152k vocabulary, 1.10x and 1.08x faster than 512 programs)
        num_splits = max(1, min(32, -(-2048 // rows), -(-vocab // block)))
    split_len = -(-vocab // num_splits)
    split_len = -(-split_len // block) * block
    num_splits = -(-vocab // split_len)
    best = torch.empty(rows, num_splits, dtype=torch.float32, device=logits.device)
    best_idx = torch.empty(rows, num_splits, dtype=torch.int64, device=logits.device)
    _gumbel_argmax_kernel[(rows, num_splits)](
        logits, logits.stride(0), temperatures, best, best_idx, seed, vocab, split_len,
        min_temperature, BLOCK=block, num_warps=4,
        FAST_LOG=logits.is_cuda and torch.version.hip is None,  # PTX: NVIDIA GPUs only
    )
    if num_splits == 1:
        return best_idx.view(rows)
    return best_idx.gather(1, best.argmax(1, keepdim=True)).view(rows)
