"""Sampling greedy and plain-temperature rows by the inverse of their CDF: one uniform a row.

triton_sampling's Gumbel race draws a uniform and two logarithms for every token of the
vocabulary, so it is bound by that arithmetic (~80 us for 256 rows of a 152k vocabulary on
an H200), not by reading the logits (~16 us). Here the noise is one uniform a row:

1. `_split_sums_kernel`, a program per (row, vocabulary split): the split's maximum M_s of
   x = logit * log2(e) / T and its sum Z_s of 2^(x - M_s), in one read of the logits with
   one exp2 a token (a greedy row: the split's argmax instead, as triton_sampling's).
2. `_draw_kernel`, a program per row: the splits' weights Z_s 2^(M_s - M) give the row's
   total W; u * W (u uniform) falls in one split, and the program walks that split's
   cumulative sum of 2^(x - M) to the token where it passes the remainder. Token i comes
   out with probability 2^(x_i - M) / W = softmax(logits / T)_i, up to float32 rounding of
   the sums. A greedy row takes the first split holding the largest value (the lowest id,
   as torch.argmax).

The draw depends on u and the logits only, not on how the vocabulary is split. Seeded and
top-k/top-p/min-p rows keep the torch path (`sampler.sample` decides).
"""

import random

import torch
import triton
import triton.language as tl

from nanovllm.kernels import triton_sampling

# the one-pass sampler's method: the inverse CDF (here) or triton_sampling's Gumbel race
INVERSE_CDF = True
LOG2E = tl.constexpr(1.4426950408889634)
NOT_FOUND = tl.constexpr(2147483647)
_rng = random.Random()


@triton.jit
def _split_sums_kernel(
    logits_ptr, stride_row, temps_ptr, max_ptr, sum_ptr, vocab_size, split_len,
    min_temperature, BLOCK: tl.constexpr,
):
    row, split = tl.program_id(0), tl.program_id(1)
    out = row * tl.num_programs(1) + split
    temp = tl.load(temps_ptr + row).to(tl.float32)
    base = logits_ptr + row.to(tl.int64) * stride_row
    lo = split * split_len
    hi = tl.minimum(lo + split_len, vocab_size)
    lanes = tl.arange(0, BLOCK)
    if temp == 0.0:  # greedy: the split's largest logit, and its lowest id in sum_ptr (ids
        # below 2^24 are exact float32s)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_idx = tl.full([BLOCK], NOT_FOUND, tl.int32)
        for start in range(lo, hi, BLOCK):
            offs = start + lanes
            x = tl.load(base + offs, mask=offs < hi, other=float("-inf")).to(tl.float32)
            take = (x > best) | ((x == best) & (offs < hi) & (offs < best_idx))
            best, best_idx = tl.where(take, x, best), tl.where(take, offs, best_idx)
        top = tl.max(best, axis=0)
        idx = tl.min(tl.where(best == top, best_idx, NOT_FOUND), axis=0)
        tl.store(max_ptr + out, top)
        tl.store(sum_ptr + out, tl.where(idx == NOT_FOUND, lo, idx).to(tl.float32))
    else:
        scale = LOG2E / tl.maximum(temp, min_temperature)
        # per lane: its maximum m and sum z of 2^(x - m); a larger x rescales the sum
        # (z 2^(m - x) + 1), one exp2 a token either way
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        z = tl.zeros([BLOCK], tl.float32)
        for start in range(lo, hi, BLOCK):
            offs = start + lanes
            x = tl.load(base + offs, mask=offs < hi, other=float("-inf")).to(tl.float32) * scale
            d = tl.exp2(-tl.abs(tl.where(x == m, 0.0, x - m)))  # (both -inf: no NaN)
            up = x > m
            z = tl.where(up, z * d + 1.0, tl.where(x > float("-inf"), z + d, z))  # -inf: none
            m = tl.maximum(m, x)
        top = tl.max(m, axis=0)
        lane_sums = tl.where(m > float("-inf"), z * tl.exp2(m - top), 0.0)
        tl.store(max_ptr + out, top)
        tl.store(sum_ptr + out, tl.sum(lane_sums, axis=0))


@triton.jit(do_not_specialize=["seed"])
def _draw_kernel(
    logits_ptr, stride_row, temps_ptr, max_ptr, sum_ptr, out_ptr, seed, vocab_size,
    split_len, num_splits, min_temperature, BLOCK: tl.constexpr, SPLITS: tl.constexpr,
):
    row = tl.program_id(0)
    temp = tl.load(temps_ptr + row).to(tl.float32)
    s = tl.arange(0, SPLITS)
    has = s < num_splits
    maxes = tl.load(max_ptr + row * num_splits + s, mask=has, other=float("-inf"))
    top = tl.max(maxes, axis=0)
    if temp == 0.0:  # the first split holding the row's largest value
        first = tl.min(tl.where(has & (maxes == top), s, SPLITS), axis=0)
        token = tl.load(sum_ptr + row * num_splits + tl.where(first == SPLITS, 0, first))
        tl.store(out_ptr + row, token.to(tl.int64))
    else:
        scale = LOG2E / tl.maximum(temp, min_temperature)
        sums = tl.load(sum_ptr + row * num_splits + s, mask=has, other=0.0)
        w = tl.where(maxes > float("-inf"), sums * tl.exp2(maxes - top), 0.0)
        cum = tl.cumsum(w, axis=0)
        target = tl.rand(seed, row) * tl.sum(w, axis=0)
        # the split where the cumulative weight passes the target (the last one with any
        # weight, should rounding put the target at the very end)
        past = has & (cum > target) & (w > 0)
        last = tl.max(tl.where(has & (w > 0), s, -1), axis=0)
        j = tl.min(tl.where(past, s, SPLITS), axis=0)
        j = tl.where(j == SPLITS, tl.maximum(last, 0), j)
        rest = target - tl.sum(tl.where(s < j, w, 0.0), axis=0)
        base = logits_ptr + row.to(tl.int64) * stride_row
        lanes = tl.arange(0, BLOCK)
        start = j * split_len
        hi = tl.minimum(start + split_len, vocab_size)
        acc = rest * 0.0
        found = NOT_FOUND + row * 0
        last_live = start  # the last token with any weight, for a target rounding past all
        while (start < hi) & (found == NOT_FOUND):
            offs = start + lanes
            x = tl.load(base + offs, mask=offs < hi, other=float("-inf")).to(tl.float32)
            p = tl.exp2(x * scale - top)
            running = acc + tl.cumsum(p, axis=0)
            hit = (running > rest) & (p > 0.0)
            found = tl.min(tl.where(hit, offs, NOT_FOUND), axis=0)
            last_live = tl.maximum(last_live, tl.max(tl.where(p > 0.0, offs, -1), axis=0))
            acc += tl.sum(p, axis=0)
            start += BLOCK
        tl.store(out_ptr + row, tl.where(found == NOT_FOUND, last_live, found).to(tl.int64))


def inverse_cdf_sample(
    logits: torch.Tensor, temperatures: torch.Tensor, min_temperature: float,
    seed: int | None = None, num_splits: int | None = None,
) -> torch.Tensor:
    """Token ids [B] (int64): argmax for rows with temperature 0, otherwise a draw from
    softmax(logits / max(T, min_temperature)). `logits` [B, V] in any float dtype, rows
    contiguous; no host sync. Each row's vocabulary is split over several programs so a
    small batch still fills the GPU."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1, "logits rows must be contiguous"
    assert vocab < 2**24, "a greedy row's token id passes through a float32"
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    if seed is None:
        seed = _rng.getrandbits(31)
    block = max(16, min(1024, triton.next_power_of_2(vocab)))
    if num_splits is None:  # about 2048 programs in all, as triton_sampling's race
        num_splits = max(1, min(32, -(-2048 // rows), -(-vocab // block)))
    split_len = -(-vocab // num_splits)
    split_len = -(-split_len // block) * block
    num_splits = -(-vocab // split_len)
    maxes = torch.empty(rows, num_splits, dtype=torch.float32, device=logits.device)
    sums = torch.empty_like(maxes)
    _split_sums_kernel[(rows, num_splits)](
        logits, logits.stride(0), temperatures, maxes, sums, vocab, split_len,
        min_temperature, BLOCK=block, num_warps=4)
    _draw_kernel[(rows,)](
        logits, logits.stride(0), temperatures, maxes, sums, out, seed, vocab, split_len,
        num_splits, min_temperature, BLOCK=block, SPLITS=triton.next_power_of_2(num_splits),
        num_warps=4)
    return out


def sample_one_pass(logits: torch.Tensor, temperatures: torch.Tensor, min_temperature: float,
                    seed: int | None = None) -> torch.Tensor:
    """The engine's one-pass sampler (Kernels.sample_one_pass): this module's inverse CDF,
    or with INVERSE_CDF off triton_sampling's Gumbel race."""
    if INVERSE_CDF:
        return inverse_cdf_sample(logits, temperatures, min_temperature, seed)
    return triton_sampling.gumbel_argmax(logits, temperatures, min_temperature, seed)
