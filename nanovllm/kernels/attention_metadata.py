from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """The varlen paged-attention contract shared by every backend.

    Row i of the batch owns query tokens [query_start_loc[i], query_start_loc[i+1]) of the
    flat token tensor; after this step's K/V are written its context holds
    context_lens[i] tokens, found through block_tables[i]. The query tokens are the last
    ones of that context. slot_mapping[t] is the cache slot (block * block_size + offset)
    where token t's K/V go; -1 skips a token (padding).
    """

    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B + 1] int32
    context_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    max_query_len: int
    max_context_len: int
    # host copies, so the torch backend can split rows without a device sync
    query_lens_host: list[int]
    context_lens_host: list[int]
    # what a backend derives from the above once per step for every layer (torch: each
    # decode row's cache slots), filled by the first layer that needs it
    derived: dict = field(default_factory=dict, repr=False, compare=False)
