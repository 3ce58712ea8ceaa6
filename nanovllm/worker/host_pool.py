"""The host tier's memory on one rank (`HostKVPool`): host memory, page-locked on a GPU
machine (`page_locked`), for blocks copied out of the KV cache (worker/kv_cache.py), for
swapped sequences and for prefixes evicted from the device, one contiguous slot per block.
The BlockManager decides what is copied where; `HostKVPool.copy` moves the bytes, on a
side stream on a GPU. Also how many slots fit, the check against the host's memory, and the
rates the scheduler weighs swap against recompute with (`measure_preemption_cost`).
"""

import math
import time
import weakref

import torch

from nanovllm.core.config import ResolvedConfig
from nanovllm.core.errors import ConfigError
from nanovllm.core.host_tier import PreemptionCost
from nanovllm.model.config import ModelConfig
from nanovllm.worker.kv_cache import KVCache, KVFormat, kv_bytes_per_token
from nanovllm.worker.sampling import to_device


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
    device-side gather, not a trip over PCIe. A later copy that reads those host slots
    queues behind them on the same stream."""

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
            if main is not None:  # the forward pass does not wait for the trip to the host
                main.wait_stream(self.stream)
            self._to_host(staged, out)

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
        out_hidden=cuda,
    )
