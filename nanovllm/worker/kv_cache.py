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
# an fp8 V cache transposed within each block (KVCache.bind); blocks of a power of 2 >= 16
# tokens, so a KV tile of 16 or more positions lies in one block
FP8_V_TRANSPOSED = True
# an fp8 K cache head-major within each block (KVCache.bind): a decode program's K rows of a
# block are one contiguous run instead of rows interleaved with the other heads'. The H200's
# fp8 decode ran 1.02-1.04x faster over it (benchmarks/attention.py --kv-layouts), the seed
# workload (its store included) 1.01x (scripts/gpu_plan.sh klayout; BENCHMARKS.md)
FP8_K_HEAD_MAJOR = True
# an fp8 K cache, head-major, with each block-head's float32 scales in a plane after its
# values ([block_size, head_dim] value bytes, then [block_size] scales) instead of after each
# row: a decode tile then reads 132 bytes a position instead of the padded row's 144, K and V
# 264 instead of 276 (kernels/torch_attention.py k_scale_plane). The decode attention ran
# 1.06x faster over it, the seed workload 1.03x in three rounds, 1.045x with the prefill's
# run stores (triton_kv_store.RUN_STORES; scripts/gpu_plan.sh layouts; BENCHMARKS.md)
FP8_K_SCALE_PLANE = True


@dataclass(frozen=True)
class KVFormat:
    """How one token's K (or V) of one head is stored: `width` elements of `dtype`.

    The model's dtype with width head_dim, or for kv_cache_dtype="fp8" bytes (uint8) holding
    float8 e4m3 values: width head_dim with one static scale of 1 (kv_cache_scales="tensor"),
    or `fp8_width` bytes where the 4 after the values are the float32 scale of that token and
    head ("token", chosen per token as its amax / 448), padded to 16 bytes. The kernels tell
    the formats apart by the cache's dtype and width (kernels/torch_attention.py)."""

    dtype: torch.dtype
    width: int

    @classmethod
    def of(cls, kv_cache_dtype: str, scales: str, model_dtype: torch.dtype,
           head_dim: int) -> "KVFormat":
        if kv_cache_dtype != "fp8":
            return cls(model_dtype, head_dim)
        return cls(torch.uint8, fp8_width(head_dim, scales == "token"))

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
        # then makes its cudaMallocs again (six in the seed workload: no measurable cost,
        # BENCHMARKS.md, twelfth H200 session)
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
        self.v_transposed = (FP8_V_TRANSPOSED and dtype == torch.uint8 and block_size >= 16
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
        trip through shared memory (kernels/triton_tiles.py). With FP8_K_HEAD_MAJOR an fp8
        K cache is head-major within each block too ([heads, block_size, width]; its view
        keeps the [blocks, block_size, Hkv, width] shape), and with FP8_K_SCALE_PLANE its
        scales in a plane after the values (torch_attention.k_scale_plane). The block keeps
        its bytes and place, so the host tier copies it as any other."""
        for i, attn in enumerate(model.attention_layers()):
            k = self.tensor[0, i]
            if self.v_transposed and FP8_K_HEAD_MAJOR:
                nb, bs, heads, width = k.shape
                k = k.view(nb, heads, bs, width).permute(0, 2, 1, 3)
                if FP8_K_SCALE_PLANE and width >= self.head_dim + 4:
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
