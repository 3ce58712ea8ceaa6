"""A transposed fp8 V stored by runs: where a launch stores RUN
tokens at consecutive slots from a multiple of RUN (a prefill chunk's), all in one block of
one sequence, each row of the run's V takes its RUN bytes in one store instead of one byte
from each token's program. Every token of a run decides the same from the run's slots
(`_complete_run`), so the host does nothing for it; `_store_v_run` writes a run's heads."""

import triton
import triton.language as tl

from nanovllm.kernels.triton_e4m3 import _store_fp8

RUN = tl.constexpr(16)


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
                 BLOCK_D: tl.constexpr, SCALED: tl.constexpr):
    # the V of RUN tokens from `lead` into a transposed cache at `run_at` (their first
    # position), heads mine, mine + RUN, ...: per head, _store_fp8 with the run's positions
    # as its rows, a byte apart, so each of a head's rows takes the run's RUN bytes in one store
    for h in range(mine, NUM_HEADS, RUN):
        _store_v_run_head(v_ptr, lead, stride_vt, stride_vh, stride_vd, run_at, stride_h,
                          stride_d, h, HEAD_DIM, BLOCK_D, SCALED)


@triton.jit
def _store_v_run_head(v_ptr, lead, stride_vt, stride_vh, stride_vd, run_at, stride_h,
                      stride_d, h, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                      SCALED: tl.constexpr):
    offs_t = tl.arange(0, RUN)
    offs_d = tl.arange(0, BLOCK_D)
    dim_ok = offs_d[None, :] < HEAD_DIM
    rows = (lead + offs_t).to(tl.int64)
    x = tl.load(v_ptr + rows[:, None] * stride_vt + h * stride_vh + offs_d[None, :] * stride_vd,
                mask=dim_ok, other=0.0)  # [RUN, D]
    head_at = run_at + h * stride_h
    _store_fp8(head_at, head_at, x, dim_ok, offs_t < RUN, offs_t, offs_d, 1, stride_d,
               HEAD_DIM, SCALED, True)
