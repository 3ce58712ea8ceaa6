import torch
from torch import nn

from nanovllm.kernels import Kernels
from nanovllm.kernels.attention_metadata import AttentionMetadata


class Attention(nn.Module):
    """Writes this step's K/V into the paged cache, then attends over each row's context.

    The model runner binds `k_cache`/`v_cache` ([num_blocks, block_size, Hkv, D]) once the
    cache is allocated (worker/kv_cache.py).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, kernels: Kernels):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.kernels = kernels

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                stored: bool = False):
        """`stored`: this step's K/V are in the cache already (RotaryEmbedding.and_store)."""
        kernels = self.kernels
        if not stored:
            kernels.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        fresh = (k, v) if kernels.fresh_prefill else None  # see Kernels.fresh_prefill
        return kernels.paged_attention(q, self.k_cache, self.v_cache, meta, self.scale,
                                       fresh=fresh)
