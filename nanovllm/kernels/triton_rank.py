"""The decode rows longest first, ranked on the device once per step by one launch of B
small programs (torch's sort is a radix sort of several launches).

The decode grid is (kv head x split, row slot) and slot i runs the i-th longest row
(triton_decode.py): the GPU starts programs in grid order, so no long row starts last and
runs alone at the end (LPT order).
"""

import torch
import triton
import triton.language as tl

from nanovllm.kernels.attention_metadata import AttentionMetadata
from nanovllm.kernels.triton_pdl import pdl_enter, pdl_launch

RANK_BLOCK = 128  # rows a _rank_kernel program compares at a time


def longest_first(meta: AttentionMetadata) -> torch.Tensor:
    """The rows by context length, longest first, ties in row order ([B] int32), ranked on
    the device once per step (every layer shares it; a CUDA graph replays the launch)."""
    order = meta.derived.get("longest_first")
    if order is None:
        lens = meta.context_lens
        order = torch.empty(lens.shape[0], dtype=torch.int32, device=lens.device)
        if lens.shape[0]:
            _rank_kernel[(lens.shape[0],)](lens, order, lens.shape[0], BLOCK=RANK_BLOCK,
                                           num_warps=4, **pdl_launch(lens))
        meta.derived["longest_first"] = order
    return order


@triton.jit(do_not_specialize=["num_rows"])  # see triton_tiles' _NO_RESPECIALIZE
def _rank_kernel(ctx_ptr, order_ptr, num_rows, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    # program i puts row i at its place: the rows with longer contexts, and the rows before it
    # with as long a one, go ahead of it. The rows are counted BLOCK at a time,
    # so one compiled variant serves every row count.
    pdl_enter(PDL)
    i = tl.program_id(0)
    mine = tl.load(ctx_ptr + i)
    ahead = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, num_rows, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        lens = tl.load(ctx_ptr + offs, mask=offs < num_rows, other=-1)
        ahead += ((lens > mine) | ((lens == mine) & (offs < i))).to(tl.int32)
    tl.store(order_ptr + tl.sum(ahead, 0), i)
