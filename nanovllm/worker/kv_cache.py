"""The paged KV cache of one rank: how many blocks fit, and the tensor that holds them.

One tensor [2 (K, V), layers, blocks, block_size, kv_heads, head_dim]; each attention layer
reads and writes its own [blocks, block_size, kv_heads, head_dim] views. The host tier's
memory behind it is worker/host_pool.py.
"""

import logging
import mmap
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.core.config import ResolvedConfig
from nanovllm.core.errors import ConfigError
from nanovllm.kernels.torch_attention import fp8_width, scale_plane_view
from nanovllm.model.config import ModelConfig

log = logging.getLogger("nanovllm")

CPU_KV_CACHE_GIB = 2.0  # the CPU's default budget (kv_cache_gib overrides it)


@dataclass(frozen=True)
class KVFormat:
    """How one token's K (or V) of one head is stored: `width` elements of `dtype`.

    The model's dtype with width head_dim, or for kv_cache_dtype="fp8" bytes (uint8) holding
    float8 e4m3 values: `fp8_width` bytes where the 4 after the values are the float32 scale
    of that token and head (its amax / 448), padded to 16 bytes. The kernels tell the
    formats apart by the cache's dtype (kernels/torch_attention.py)."""

    dtype: torch.dtype
    width: int

    @classmethod
    def of(cls, kv_cache_dtype: str, model_dtype: torch.dtype, head_dim: int) -> "KVFormat":
        if kv_cache_dtype != "fp8":
            return cls(model_dtype, head_dim)
        return cls(torch.uint8, fp8_width(head_dim))

    @property
    def bytes_per_head(self) -> int:
        return self.width * torch.empty(0, dtype=self.dtype).element_size()


def kv_bytes_per_token(model: ModelConfig, fmt: KVFormat) -> int:
    return 2 * model.num_hidden_layers * model.num_key_value_heads * fmt.bytes_per_head


def plan_num_blocks(
    config: ResolvedConfig,
    model: ModelConfig,
    fmt: KVFormat,
    device: torch.device,
    activation_peak: Callable[[], int],
) -> int:
    """How many blocks the cache gets: num_kv_blocks if given, else kv_cache_gib, else on a
    GPU what gpu_memory_utilization leaves once the weights and the largest step's
    activations (`activation_peak()`, a profiling pass) are set aside; 2 GiB on a CPU."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = kv_bytes_per_token(model, fmt) * config.block_size
    if config.kv_cache_gib is not None:
        budget = config.kv_cache_gib * 2**30
    elif device.type == "cuda":
        peak = activation_peak()
        # the profiling pass's memory stays in torch's cache (counted as free here, the peak
        # set aside once) until CUDA graph capture empties that cache; the first full step
        # then makes its cudaMallocs again (a handful, at no measurable cost)
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
        self, model: ModelConfig, num_blocks: int, block_size: int, fmt: KVFormat,
        device: torch.device,
    ) -> None:
        dtype = fmt.dtype
        shape = (2, model.num_hidden_layers, num_blocks, block_size, model.num_key_value_heads,
                 fmt.width)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.head_dim = model.head_dim
        # an fp8 V cache is stored transposed within each block (see bind)
        self.v_transposed = (dtype == torch.uint8 and block_size >= 16
                             and block_size & (block_size - 1) == 0)
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
        """Point each attention layer at its K and V views ([blocks, block_size, Hkv, width]).

        An fp8 V cache is stored transposed within each block: a head's block is [width,
        block_size] bytes, a row per dimension, the block's positions contiguous (its view
        has unit stride over slots). P @ V contracts over positions, and fp8 values laid out
        the other way reach the tensor cores only one byte per load or through a second
        trip through shared memory (kernels/triton/tiles.py). Its K cache is head-major
        within each block ([heads, block_size, width]; its view keeps the [blocks,
        block_size, Hkv, width] shape), so a decode program's K rows of a block are one
        contiguous run, with the scales in a plane after the values
        (torch_attention.k_scale_plane), so a tile reads 132 bytes a position, not the
        padded row's 144. The block keeps its bytes and place, so the host tier copies it as
        any other."""
        for i, attn in enumerate(model.attention_layers()):
            k = self.tensor[0, i]
            if self.v_transposed:
                nb, bs, heads, width = k.shape
                k = k.view(nb, heads, bs, width).permute(0, 2, 1, 3)
                k = scale_plane_view(k, self.head_dim)
            attn.k_cache = k
            v = self.tensor[1, i]
            if self.v_transposed:
                nb, bs, heads, width = v.shape
                v = v.view(nb, heads, width, bs).permute(0, 3, 1, 2)
            attn.v_cache = v

    @staticmethod
    def unbind(model: nn.Module) -> None:
        for attn in model.attention_layers():
            attn.k_cache = attn.v_cache = torch.empty(0)
