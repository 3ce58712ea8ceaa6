"""The paged KV cache of one rank: how many blocks fit, and the tensor that holds them.

One tensor [2 (K, V), layers, blocks, block_size, kv_heads, head_dim]; each attention layer
reads and writes its own [blocks, block_size, kv_heads, head_dim] views.

The host tier (`HostKVPool`): host memory (page-locked on a GPU machine, `page_locked`) for
blocks copied out of the cache, for swapped sequences and for prefixes evicted from the
device, one contiguous slot per block. The BlockManager decides what is copied where;
`HostKVPool.copy` moves the bytes, on a side stream on a GPU.
"""

import logging
import math
import mmap
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.core.config import ResolvedConfig
from nanovllm.core.errors import ConfigError
from nanovllm.core.host_tier import PreemptionCost
from nanovllm.kernels.torch_attention import fp8_width
from nanovllm.model.config import ModelConfig
from nanovllm.worker.sampling import to_device

log = logging.getLogger("nanovllm")

CPU_KV_CACHE_GIB = 2.0  # the CPU's default budget (kv_cache_gib overrides it)
# an fp8 V cache transposed within each block (KVCache.bind); blocks of a power of 2 >= 16
# tokens, so a KV tile of 16 or more positions lies in one block
FP8_V_TRANSPOSED = True


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
        self, model: ModelConfig, num_blocks: int, block_size: int, fmt: KVFormat,
        device: torch.device,
    ) -> None:
        dtype = fmt.dtype
        shape = (2, model.num_hidden_layers, num_blocks, block_size, model.num_key_value_heads,
                 fmt.width)
        self.num_blocks, self.block_size = num_blocks, block_size
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
        trip through shared memory (kernels/triton_attention.py). The block keeps its bytes
        and place, so the host tier copies it as any other."""
        for i, attn in enumerate(model.attention_layers()):
            attn.k_cache = self.tensor[0, i]
            v = self.tensor[1, i]
            if self.v_transposed:
                nb, bs, heads, width = v.shape
                v = v.view(nb, heads, width, bs).permute(0, 3, 1, 2)
            attn.v_cache = v

    @staticmethod
    def unbind(model: nn.Module) -> None:
        for attn in model.attention_layers():
            attn.k_cache = attn.v_cache = torch.empty(0)


def plan_num_host_blocks(config: ResolvedConfig, model: ModelConfig, fmt: KVFormat) -> int:
    """Host-tier blocks in swap_space + cpu_offload_gib GiB."""
    per_block = kv_bytes_per_token(model, fmt) * config.block_size
    return int((config.swap_space + config.cpu_offload_gib) * 2**30 // per_block)


class HostKVPool:
    """Host slots for KV blocks: [slots, 2 (K, V), layers, block_size, kv_heads, head_dim],
    so each block is one contiguous copy each way.

    On a GPU a step's copies run on a side stream, and the step's forward pass waits only
    for what it needs: the blocks copied out gathered into a device buffer of their own
    (fast, device memory) and the blocks copied in landed. The gathered blocks then cross
    to the host while the forward pass runs, so a swap-out or an offload costs the step a
    device-side gather, not a trip over PCIe (`overlap_out`; False waits for the host
    copies too, as before). A later copy that reads those host slots queues behind them on
    the same stream."""

    overlap_out = True  # class-wide: benchmarks/kv_tiers.py compares both in one run

    def __init__(self, cache: KVCache, num_slots: int) -> None:
        t = cache.tensor
        self.cache = cache
        self.device = t.device
        shape = (num_slots, 2, t.shape[1], *t.shape[3:])
        check_host_memory(math.prod(shape) * t.dtype.itemsize)
        pin = t.device.type == "cuda"
        self.tensor = page_locked(shape, t.dtype) if pin else torch.empty(shape, dtype=t.dtype)
        self.stream = torch.cuda.Stream(t.device) if pin else None

    @property
    def gib(self) -> float:
        return self.tensor.numel() * self.tensor.element_size() / 2**30

    def copy(self, out: list[tuple[int, int]], in_: list[tuple[int, int]]) -> None:
        """Run one step's copies as if every (device block -> host slot) ran first, then
        every (host slot -> device block): a block offloaded in this step and found by a
        prefix lookup in the same step is read back from the gathered copy on the device,
        since its trip to the host may still be under way. On a GPU they run on a side
        stream that starts after the work already queued (the steps that wrote those
        blocks); the step's forward pass waits for the gather of `out` and for `in_` (see
        the class); the host copies are asynchronous (pinned memory)."""
        if not out and not in_:
            return
        main = None
        if self.stream is not None:
            main = torch.cuda.current_stream(self.device)
            self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):  # no-op on a CPU (stream None)
            staged = self._gather(out)  # before `in_` may overwrite one of those blocks
            self._from_host(in_, out, staged)
            if main is not None and self.overlap_out:  # the forward pass does not wait
                main.wait_stream(self.stream)         # for the trip to the host
            self._to_host(staged, out)
        if main is not None and not self.overlap_out:
            main.wait_stream(self.stream)

    def _gather(self, out: list[tuple[int, int]]) -> torch.Tensor | None:
        """The blocks of `out` as [n, 2, layers, ...], a buffer of their own on the device."""
        if not out:
            return None
        blocks = self._index([b for b, _ in out])
        return self.cache.tensor.index_select(2, blocks).movedim(2, 0).contiguous()

    def _index(self, ids: list[int]) -> torch.Tensor:
        """Block ids on the device, with no host sync (sampling.to_device): a plain copy
        from a list would make the host wait for the side stream, so for the previous
        step's forward pass and earlier steps' host copies."""
        return to_device(ids, torch.int64, self.device)

    def _to_host(self, staged: torch.Tensor | None, out: list[tuple[int, int]]) -> None:
        for i, (_, slot) in enumerate(out):  # one contiguous copy per slot
            self.tensor[slot].copy_(staged[i], non_blocking=True)

    def _from_host(self, in_: list[tuple[int, int]], out: list[tuple[int, int]],
                   staged: torch.Tensor | None) -> None:
        """Copy `in_` into the cache; a slot this step also writes (`out`, gathered in
        `staged`) comes from its last write there, as a host copy after `out` would read."""
        if not in_:
            return
        written = {slot: i for i, (_, slot) in enumerate(out)}  # the last write wins
        cache = self.cache.tensor  # [2, layers, blocks, ...]
        rows = torch.empty((len(in_), *self.tensor.shape[1:]), dtype=cache.dtype,
                           device=self.device)
        for i, (slot, _) in enumerate(in_):
            j = written.get(slot)
            rows[i].copy_(self.tensor[slot] if j is None else staged[j], non_blocking=True)
        cache.index_copy_(2, self._index([b for _, b in in_]), rows.movedim(0, 2))


HOST_MEMORY_SHARE = 0.9  # of the host's available memory, the most a host tier may take


def host_memory_available() -> int | None:
    """The host's available memory in bytes (Linux's MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_host_memory(nbytes: int) -> None:
    """A host tier that would not fit in the host's available memory is refused before it
    is allocated (a pinned pool is committed at once: the OS would kill the process or
    swap instead)."""
    available = host_memory_available()
    if available is not None and nbytes > HOST_MEMORY_SHARE * available:
        raise ConfigError(
            f"the host KV tier needs {nbytes / 2**30:.1f} GiB (swap_space + cpu_offload_gib) "
            f"but this host has {available / 2**30:.1f} GiB available: lower swap_space or "
            f"cpu_offload_gib to at most {HOST_MEMORY_SHARE * available / 2**30:.1f} GiB in "
            f"all")


REGISTER_MIN_BYTES = 1 << 30  # page_locked registers pools from this size up


def page_locked(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Host memory of `shape`, page-locked so copies to and from a GPU run asynchronously.

    torch's pinned allocator rounds each allocation up to a power of two: a 20 GiB host
    tier would pin 32 GiB of the machine. Where that would waste more than a sixteenth of a
    pool of a GiB or more, the pool is ordinary memory registered with CUDA
    (cudaHostRegister) instead, exactly its size, unregistered when the tensor is freed.
    Smaller or near-power-of-two pools (the default 4 GiB swap space) take the pinned
    allocator's memory as before."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not registers(nbytes):
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    t = torch.empty(shape, dtype=dtype)
    ptr = t.data_ptr()
    err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
    if int(err) != 0:
        raise ConfigError(
            f"the host KV tier could not page-lock {nbytes / 2**30:.2f} GiB of host memory "
            f"(cudaHostRegister: {err}); lower swap_space + cpu_offload_gib, or raise the "
            f"limit on locked memory (ulimit -l)")
    weakref.finalize(t, _unregister, ptr)
    return t


def registers(nbytes: int) -> bool:
    """Whether `page_locked` registers a pool of `nbytes` rather than take the pinned
    allocator's next power of two."""
    rounded = 1 << max(nbytes - 1, 0).bit_length()
    return nbytes >= REGISTER_MIN_BYTES and rounded - nbytes > nbytes // 16


def _unregister(ptr: int) -> None:
    try:
        torch.cuda.synchronize()  # no copy may still be reading or writing the memory
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # noqa: BLE001 - at exit CUDA may be gone, and the memory with it
        pass


def measure_preemption_cost(cache: KVCache, model: ModelConfig, max_tokens: int,
                            dtype: torch.dtype) -> PreemptionCost:
    """The rates the scheduler weighs swap against recompute with, measured here: one
    64 MiB copy device -> host -> device, and a matmul of the model's MLP shape at
    `max_tokens` rows (a full prefill chunk)."""
    t = cache.tensor  # `dtype`: the model's (the cache's may be bytes of fp8)
    device = t.device
    cuda = device.type == "cuda"

    def timed(fn) -> float:
        fn()  # warm-up
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    numel = 64 * 2**20 // t.element_size()
    src = torch.empty(numel, dtype=t.dtype, device=device)
    host = torch.empty(numel, dtype=t.dtype, pin_memory=cuda)
    copy_s = timed(lambda: (host.copy_(src, non_blocking=True), src.copy_(host, non_blocking=True)))
    rows = max(16, min(max_tokens, 4096))
    x = torch.randn(rows, model.hidden_size, dtype=dtype, device=device)
    w = torch.randn(model.hidden_size, model.intermediate_size, dtype=dtype, device=device)
    mm_s = timed(lambda: x @ w)
    per_block = t[:, :, 0].numel() * t.element_size()
    h, q_width = model.hidden_size, model.num_attention_heads * model.head_dim
    kv_width = model.num_key_value_heads * model.head_dim
    params = model.num_hidden_layers * (h * (2 * q_width + 2 * kv_width)
                                        + 3 * h * model.intermediate_size)
    params += model.vocab_size * h  # the LM head (one row a sequence: an upper bound)
    return PreemptionCost(
        block_bytes=per_block,
        copy_bytes_per_s=2 * numel * t.element_size() / copy_s,
        flops_per_token=2.0 * params,
        # QK^T and PV over a causal n x n triangle: 2 x 2 x n^2 / 2 x width, per layer
        attention_flops=2.0 * model.num_hidden_layers * q_width,
        flops_per_s=2.0 * rows * model.hidden_size * model.intermediate_size / mm_s,
        out_hidden=cuda and HostKVPool.overlap_out,
    )
