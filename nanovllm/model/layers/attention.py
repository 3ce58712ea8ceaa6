import torch
from torch import nn

from nanovllm.model.attention import torch_backend
from nanovllm.model.attention.metadata import AttentionMetadata


def backend_for(device: torch.device):
    """Triton kernels on CUDA; plain torch (the reference) everywhere else."""
    if device.type == "cuda":
        from nanovllm.model.attention import triton_backend

        return triton_backend
    return torch_backend


class Attention(nn.Module):
    """Writes this step's K/V into the paged cache, then attends over each row's context.

    The model runner assigns `k_cache`/`v_cache` ([num_blocks, block_size, Hkv, D])
    once the cache is allocated.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.backend = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata):
        if self.backend is None:
            self.backend = backend_for(q.device)
        self.backend.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        return self.backend.paged_attention(q, self.k_cache, self.v_cache, meta, self.scale)
