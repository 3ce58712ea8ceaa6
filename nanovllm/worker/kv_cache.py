"""The paged KV cache of one rank: how many blocks fit, and the tensor that holds them.

One tensor [2 (K, V), layers, blocks, block_size, kv_heads, head_dim]; each attention layer
reads and writes its own [blocks, block_size, kv_heads, head_dim] views. This is where
preemption by swap and a host-memory tier will live.
"""

import logging
import mmap
from collections.abc import Callable

import torch
from torch import nn

from nanovllm.core.config import ResolvedConfig
from nanovllm.core.errors import ConfigError
from nanovllm.model.config import ModelConfig

log = logging.getLogger("nanovllm")

CPU_KV_CACHE_GIB = 2.0  # the CPU's default budget (kv_cache_gib overrides it)


def kv_bytes_per_token(model: ModelConfig, dtype: torch.dtype) -> int:
    elem = torch.empty(0, dtype=dtype).element_size()
    return 2 * model.num_hidden_layers * model.num_key_value_heads * model.head_dim * elem


def plan_num_blocks(
    config: ResolvedConfig,
    model: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    activation_peak: Callable[[], int],
) -> int:
    """How many blocks the cache gets: num_kv_blocks if given, else kv_cache_gib, else on a
    GPU what gpu_memory_utilization leaves once the weights and the largest step's
    activations (`activation_peak()`, a profiling pass) are set aside; 2 GiB on a CPU."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = kv_bytes_per_token(model, dtype) * config.block_size
    if config.kv_cache_gib is not None:
        budget = config.kv_cache_gib * 2**30
    elif device.type == "cuda":
        peak = activation_peak()
        # the allocator keeps the profiling pass's memory cached (not emptied), so the first
        # large step of real work finds it there instead of calling cudaMalloc; that cached
        # pool counts as free here, the peak is set aside once
        free, total = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        budget = free + cached - total * (1 - config.gpu_memory_utilization) - peak
    else:
        budget = CPU_KV_CACHE_GIB * 2**30
    num = int(budget // per_block)
    if num < 1:
        raise ConfigError(
            "no memory left for the KV cache; raise gpu_memory_utilization or kv_cache_gib, "
            "or lower max_num_batched_tokens"
        )
    return num


class KVCache:
    """The cache tensor of `num_blocks` blocks, bound to the model's attention layers."""

    def __init__(
        self, model: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (2, model.num_hidden_layers, num_blocks, block_size, model.num_key_value_heads,
                 model.head_dim)
        self.num_blocks, self.block_size = num_blocks, block_size
        if device.type == "cpu":
            # anonymous mmap pages are zeroed by the OS when first touched: no 2 GiB memset
            nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
            self._buffer = mmap.mmap(-1, nbytes)
            self.tensor = torch.frombuffer(self._buffer, dtype=dtype).view(shape)
        else:
            self.tensor = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def gib(self) -> float:
        return self.tensor.numel() * self.tensor.element_size() / 2**30

    def bind(self, model: nn.Module) -> None:
        """Point each attention layer at its K and V views."""
        for i, attn in enumerate(model.attention_layers()):
            attn.k_cache = self.tensor[0, i]
            attn.v_cache = self.tensor[1, i]

    @staticmethod
    def unbind(model: nn.Module) -> None:
        for attn in model.attention_layers():
            attn.k_cache = attn.v_cache = torch.empty(0)
