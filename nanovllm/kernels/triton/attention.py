"""Paged attention in Triton: the CUDA backend, same contract and results as `torch_attention`.

Two entry points:

- `store_kv` (kv_store.py, re-exported here): one program per token copies its K/V
  into the paged cache (slot -1 skips), quantizing for an fp8 cache.
- `paged_attention`: rows with one query token (decode) go to decode.py's kernel,
  one program per (row, kv head, split), the splits combined by a reduce (flash-decoding);
  rows with several (prefill, chunked prefill over a cached prefix) to prefill.py's,
  one program per (tile of a row's tokens, kv head). Both loop over tiles of the cache with
  tiles.py's loads and online-softmax step.

Launch grids depend only on tensor shapes and python ints, never on device values, so a
decode step can be captured in a CUDA graph (what each launch bakes in: the decode and
prefill modules' docstrings). The path itself: meta.max_query_len == 1 runs the decode
kernel alone; otherwise the prefill kernel runs, plus the decode kernel if query_lens_host
has a 1. Everything else (query_start_loc, context_lens, block_tables, slot_mapping) is
read on the device, so replaying a captured decode graph with new values of those is correct
as long as every context fits the captured block table width.

Padding rows (context_len 0, query_len 0 or 1, slot -1) produce zeros in their own output
row, or nothing if their query_len is 0, never NaN, and touch no cache slot.
"""

import torch

from nanovllm.kernels.attention_metadata import AttentionMetadata
from nanovllm.kernels.triton.decode import launch_decode

# the backend's other entry point
from nanovllm.kernels.triton.kv_store import store_kv  # noqa: F401
from nanovllm.kernels.triton.prefill import launch_prefill
from nanovllm.kernels.triton.tiles import LOG2E, TileConfig


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    num_splits: int | None = None,
    prefill_config: TileConfig | None = None,
    decode_config: TileConfig | None = None,
    fresh: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention of q ([T, Hq, D], any strides) over each row's cached context; [T, Hq, D].

    Same contract as `torch_attention.paged_attention`. `num_splits` fixes the decode KV
    splits (default: `choose_num_splits` from the row count and meta.max_context_len);
    the configs override tile sizes. `fresh`: this step's K and V ([T, Hkv, D] each, in q's
    dtype, as stored): prefill rows read their own positions from them, the earlier ones
    from the cache (the same values over a cache of q's dtype; over an fp8 one, the values
    before rounding); decode rows read the cache only. See the module
    docstring for what a launch bakes in.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads is not a multiple of {num_kv_heads} kv heads")
    out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or meta.context_lens.shape[0] == 0:
        return out
    scale_log2 = scale * LOG2E
    only_decode = meta.max_query_len == 1
    has_decode_rows = only_decode or 1 in meta.query_lens_host
    if has_decode_rows:
        launch_decode(q, k_cache, v_cache, out, scale_log2, meta, num_splits, decode_config)
    if not only_decode:  # (the prefill kernel skips the decode rows)
        launch_prefill(q, k_cache, v_cache, out, scale_log2, meta, prefill_config, fresh,
                       skip_decode=has_decode_rows)
    return out
