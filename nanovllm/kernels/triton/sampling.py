"""Sampling greedy and plain-temperature rows by the inverse of their CDF: one uniform a row.

A Gumbel race would draw a uniform and two logarithms for every token of the vocabulary,
so its time would go to that arithmetic, not to reading the logits. Here the noise is one
uniform a row, in two launches:

1. `_tile_sums_kernel`, programs over (row, run of tiles of TILE logits): each tile's
   maximum m_t of x = logit * log2(e) / T and its sum s_t of 2^(x - m_t), one read of the
   logits and one exp2 a token (a greedy row: the tiles' maxima of the logits alone).
2. `_draw_kernel`, a program per row: the tiles' weights s_t 2^(m_t - M) (M the row's
   maximum) give the row's total W; u * W (u uniform) falls in one tile, and the program
   reads that tile's logits and takes the token where their cumulative 2^(x - M) passes
   the remainder. Token i comes out with probability 2^(x_i - M) / W = softmax(logits /
   T)_i, up to float32 rounding of the sums. A greedy row takes the first tile holding the
   row's largest value and its first id holding it (torch.argmax's tie rule).

The draw depends on u and the logits only, not on how the tiles are spread over programs.
Seeded and top-k/top-p/min-p rows keep the torch path (`sampler.sample` decides).
"""

import random

import torch
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
TILE = 1024  # logits a tile: a row of Qwen3's 151,936 has 149 tiles
NOT_FOUND = tl.constexpr(2147483647)
_rng = random.Random()


@triton.jit(do_not_specialize=["tiles_per_program"])  # a row count's own: one variant for all
def _tile_sums_kernel(
    logits_ptr, stride_row, temps_ptr, max_ptr, sum_ptr, vocab_size, tiles_per_program,
    num_tiles, min_temperature, BLOCK: tl.constexpr,
):
    # one program per (row, run of tiles): each tile's maximum of x (x = logits * log2(e) /
    # T, or the logits of a greedy row) and, for a temperature row, its sum of 2^(x - max)
    row, part = tl.program_id(0), tl.program_id(1)
    temp = tl.load(temps_ptr + row).to(tl.float32)
    scale = tl.where(temp == 0.0, 1.0, LOG2E / tl.maximum(temp, min_temperature))
    base = logits_ptr + row.to(tl.int64) * stride_row
    lanes = tl.arange(0, BLOCK)
    first = part * tiles_per_program
    for t in range(first, tl.minimum(first + tiles_per_program, num_tiles)):
        offs = t * BLOCK + lanes
        x = tl.load(base + offs, mask=offs < vocab_size, other=float("-inf")).to(tl.float32)
        x = x * scale
        top = tl.max(x, axis=0)
        tl.store(max_ptr + row * num_tiles + t, top)
        if temp != 0.0:
            p = tl.exp2(x - tl.where(top == float("-inf"), 0.0, top))  # an all -inf tile: 0
            tl.store(sum_ptr + row * num_tiles + t, tl.sum(p, axis=0))


@triton.jit(do_not_specialize=["seed"])
def _draw_kernel(
    logits_ptr, stride_row, temps_ptr, max_ptr, sum_ptr, out_ptr, seed, vocab_size,
    num_tiles, min_temperature, BLOCK: tl.constexpr, TILES: tl.constexpr,
):
    # one program per row: the tile its token lies in, from the tiles' statistics, then the
    # token, from that tile's logits
    row = tl.program_id(0)
    temp = tl.load(temps_ptr + row).to(tl.float32)
    tiles = tl.arange(0, TILES)
    has = tiles < num_tiles
    maxes = tl.load(max_ptr + row * num_tiles + tiles, mask=has, other=float("-inf"))
    top = tl.max(maxes, axis=0)
    base = logits_ptr + row.to(tl.int64) * stride_row
    lanes = tl.arange(0, BLOCK)
    if temp == 0.0:  # argmax: the first tile holding the row's largest value, its first
        t = tl.min(tl.where(has & (maxes == top), tiles, TILES), axis=0)
        t = tl.where(t == TILES, 0, t)  # an all -inf row: id 0, as torch.argmax
        offs = t * BLOCK + lanes
        x = tl.load(base + offs, mask=offs < vocab_size, other=float("-inf")).to(tl.float32)
        token = tl.min(tl.where((x == top) & (offs < vocab_size), offs, NOT_FOUND), axis=0)
        tl.store(out_ptr + row, tl.where(token == NOT_FOUND, t * BLOCK, token).to(tl.int64))
    else:
        scale = LOG2E / tl.maximum(temp, min_temperature)
        sums = tl.load(sum_ptr + row * num_tiles + tiles, mask=has, other=0.0)
        w = tl.where(maxes > float("-inf"), sums * tl.exp2(maxes - top), 0.0)
        cum = tl.cumsum(w, axis=0)
        target = tl.rand(seed, row) * tl.sum(w, axis=0)
        # the tile where the cumulative weight passes the target (the last with any weight,
        # should rounding put the target at the very end)
        t = tl.min(tl.where(has & (cum > target) & (w > 0), tiles, TILES), axis=0)
        last = tl.max(tl.where(has & (w > 0), tiles, -1), axis=0)
        t = tl.where(t == TILES, tl.maximum(last, 0), t)
        rest = target - tl.sum(tl.where(tiles < t, w, 0.0), axis=0)
        offs = t * BLOCK + lanes
        x = tl.load(base + offs, mask=offs < vocab_size, other=float("-inf")).to(tl.float32)
        p = tl.exp2(x * scale - top)
        live = p > 0.0
        token = tl.min(tl.where((tl.cumsum(p, axis=0) > rest) & live, offs, NOT_FOUND), axis=0)
        last_live = tl.max(tl.where(live, offs, -1), axis=0)
        token = tl.where(token == NOT_FOUND, tl.maximum(last_live, t * BLOCK), token)
        tl.store(out_ptr + row, token.to(tl.int64))


def sample_one_pass(
    logits: torch.Tensor, temperatures: torch.Tensor, min_temperature: float,
    seed: int | None = None, num_splits: int | None = None,
) -> torch.Tensor:
    """Token ids [B] (int64): argmax for rows with temperature 0, otherwise a draw from
    softmax(logits / max(T, min_temperature)). `logits` [B, V] in any float dtype, rows
    contiguous; no host sync. `num_splits`: programs a row for the tiles' statistics (by
    default enough that a small batch still fills the GPU)."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1, "logits rows must be contiguous"
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    if seed is None:
        seed = _rng.getrandbits(31)
    block = max(16, min(TILE, triton.next_power_of_2(vocab)))
    num_tiles = -(-vocab // block)
    if num_splits is None:  # about 2048 programs in all
        num_splits = max(1, min(32, -(-2048 // rows)))
    per_program = -(-num_tiles // min(num_splits, num_tiles))
    maxes = torch.empty(rows, num_tiles, dtype=torch.float32, device=logits.device)
    sums = torch.empty_like(maxes)
    _tile_sums_kernel[(rows, -(-num_tiles // per_program))](
        logits, logits.stride(0), temperatures, maxes, sums, vocab, per_program, num_tiles,
        min_temperature, BLOCK=block, num_warps=4)
    _draw_kernel[(rows,)](
        logits, logits.stride(0), temperatures, maxes, sums, out, seed, vocab, num_tiles,
        min_temperature, BLOCK=block, TILES=triton.next_power_of_2(num_tiles), num_warps=4)
    return out
