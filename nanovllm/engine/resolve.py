"""From what a user asks for (EngineConfig) to what an engine runs with (ResolvedConfig).

Every automatic choice is made here, once: the device and dtype, the kernels, CUDA graphs,
overlap, admission batching and the context length. The KV cache's size is known only once
the model is loaded (on a GPU it is what memory is left after a profiling step), so
`fit_kv_cache` completes the config then; nothing changes it afterwards.
"""

import dataclasses
import logging
import os

import torch

from nanovllm.core.config import EngineConfig, ResolvedConfig
from nanovllm.core.errors import ConfigError
from nanovllm.model.config import ModelConfig
from nanovllm.model.parallel import check_shardable
from nanovllm.worker.host_pool import host_memory_available

log = logging.getLogger("nanovllm")

GPU_ADMISSION_BATCH = 16  # with CUDA graphs, see EngineConfig.admission_batch
GPU_SWAP_GIB = 4.0  # EngineConfig.swap_space on a GPU (at most a quarter of the host's memory)
BLOCK_SIZE = 16  # EngineConfig.block_size, but:
FP8_BLOCK_SIZE = 128  # an fp8 cache the Triton kernels read: 128-position tiles in one block


def resolve_config(
    config: EngineConfig, model: ModelConfig, quantized_file: bool = False
) -> ResolvedConfig:
    """Everything but the KV cache's size, which `fit_kv_cache` adds. `quantized_file`: the
    checkpoint is a GGUF file (whose 4/8-bit weights may stay packed)."""
    device = _device(config.device)
    cuda = device == "cuda"
    context = model.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > context:
        raise ConfigError(
            f"max_model_len={config.max_model_len} is longer than the model's context of "
            f"{context} tokens (max_position_embeddings); use at most {context}"
        )
    graphs = cuda and not config.enforce_eager
    dtype = _dtype(config.dtype, model.dtype, device)
    native = _native(config, cuda, dtype)
    attention = _attention(config.attention_backend, cuda, native)
    max_num_seqs, max_num_batched_tokens = _step_limits(config, cuda)
    admission = config.admission_batch
    if admission is None:  # graphs make decode-only steps the cheap ones
        admission = min(GPU_ADMISSION_BATCH, max_num_seqs) if graphs else 1
    if admission > max_num_seqs:
        raise ConfigError(f"admission_batch={admission} is invalid: use an integer in "
                          f"[1, max_num_seqs={max_num_seqs}]")
    block_size = _block_size(config, attention, cuda)
    kernels = _kernels(config, cuda, native)
    _check_tensor_parallel(config.tensor_parallel_size, device, model)
    return ResolvedConfig(
        asked=config,
        device=device,
        dtype=dtype,
        max_model_len=config.max_model_len or context,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=block_size,
        num_kv_blocks=config.num_kv_blocks,
        admission_batch=admission,
        cuda_graphs=graphs,
        overlap=cuda if config.overlap is None else config.overlap,
        kernels=kernels,
        attention_backend=attention,
        num_threads=_threads(config, device),
        weight_format=_weight_format(config.weight_format, device, quantized_file),
        swap_space=(default_swap_gib(host_memory_available())
                    if cuda and config.enable_prefix_caching else 0.0)
        if config.swap_space is None else config.swap_space,
        # split-K partials are summed by the Triton residual-add RMSNorm; under tensor
        # parallelism o_proj and down_proj are all-reduced, which needs their whole output
        split_k=kernels == "triton" and config.tensor_parallel_size == 1,
    )


def _block_size(config: EngineConfig, attention: str, cuda: bool) -> int:
    """The Triton kernels read a tile of a transposed fp8 V cache from one block (see
    worker/kv_cache.py), so 16-token blocks would mean 16-token tiles, far slower on a GPU;
    a bf16 cache runs as fast with 16 as with 128."""
    fp8_tiles = attention == "triton" and config.kv_cache_dtype == "fp8" and cuda
    if config.block_size is None:
        return FP8_BLOCK_SIZE if fp8_tiles else BLOCK_SIZE
    if fp8_tiles and config.block_size < FP8_BLOCK_SIZE:
        log.warning("block_size=%d with the fp8 KV cache: its attention tiles are then %d "
                    "positions, and it runs slower than with the default %d",
                    config.block_size, config.block_size, FP8_BLOCK_SIZE)
    return config.block_size


def fit_kv_cache(resolved: ResolvedConfig, num_blocks: int,
                 num_host_blocks: int = 0) -> ResolvedConfig:
    """The final config once the KV cache holds `num_blocks` blocks (and the host tier
    `num_host_blocks`): an automatic max_model_len shrinks to what the cache holds; an
    explicit one must fit."""
    asked = resolved.asked
    tokens = num_blocks * resolved.block_size
    max_model_len = resolved.max_model_len
    if asked.max_model_len is None:
        max_model_len = min(max_model_len, tokens)
    elif max_model_len > tokens:
        raise ConfigError(
            f"the KV cache holds {tokens} tokens but max_model_len={max_model_len} needs at "
            "least that many for one sequence; lower max_model_len or give the cache more "
            "memory (num_kv_blocks, kv_cache_gib, gpu_memory_utilization)"
        )
    max_num_seqs, admission = resolved.max_num_seqs, resolved.admission_batch
    if asked.max_num_seqs is None and max_num_seqs > num_blocks:
        # every running sequence holds a block: more rows than blocks could never run
        max_num_seqs = max(1, num_blocks)
        admission = min(admission, max_num_seqs)
    return dataclasses.replace(resolved, num_kv_blocks=num_blocks, max_model_len=max_model_len,
                               num_host_blocks=num_host_blocks, max_num_seqs=max_num_seqs,
                               admission_batch=admission)


def _weight_format(name: str, device: str, quantized_file: bool) -> str:
    if name in ("int4", "int4-bf16") and device != "cpu":
        raise ConfigError(
            f"weight_format={name!r} runs on the CPU only (torch's packed int4/int8 CPU "
            "kernels); use weight_format='dense' or 'auto' on a GPU"
        )
    if name == "auto":
        name = "int4-bf16" if device == "cpu" else "dense"
    return name if quantized_file else "dense"  # a float checkpoint has nothing to pack


def _device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' but no CUDA GPU is visible; use device='cpu' or 'auto'")
    return name


def _dtype(name: str, model_dtype: str, device: str) -> str:
    if name == "auto":
        # CPUs are fastest and exact in float32; GPUs use the checkpoint's half dtype
        name = "float32" if device == "cpu" else model_dtype
        if device == "cuda" and name == "float32":
            name = "bfloat16"
    if name == "bfloat16" and device == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError("this GPU does not support bfloat16; use dtype='float16'")
    return name


def _triton_runs(cuda: bool) -> bool:
    # on a CPU, Triton kernels run only in its interpreter (slow: for tests)
    return cuda or os.environ.get("TRITON_INTERPRET") == "1"


def _native(config: EngineConfig, cuda: bool, dtype: str) -> bool:
    """Whether the CPU's native kernels (kernels/cpu_native.py) run: asked for, or by default
    on a CPU in float32 with a float32 cache, where the C compiler builds them, unless the
    Triton ops (fused_kernels) were asked for."""
    if config.native_kernels is False or (config.native_kernels is None and (
            cuda or config.fused_kernels)):
        return False  # not asked, and another choice of kernels was
    if cuda:
        why = "they are the CPU's kernels; on a GPU the Triton ones run"
    elif dtype != "float32" or config.kv_cache_dtype != "auto":
        why = "they compute in float32 over a float32 KV cache: use dtype='float32' and " \
              "kv_cache_dtype='auto'"
    else:
        from nanovllm.kernels import cpu_native

        why = cpu_native.available()  # no compiler, or a cache it cannot build into
        if why and not config.native_kernels:
            log.warning("the native CPU kernels are not available (%s): running the torch "
                        "ones", why)
    if why and config.native_kernels:
        raise ConfigError(f"native_kernels=True cannot run here: {why}")
    return not why


def _kernels(config: EngineConfig, cuda: bool, native: bool = False) -> str:
    fused = cuda if config.fused_kernels is None else config.fused_kernels
    if fused and not _triton_runs(cuda):
        raise ConfigError(
            "fused_kernels=True needs a CUDA GPU (on a CPU, Triton's interpreter: set "
            "TRITON_INTERPRET=1); leave it unset to use them where they run"
        )
    if fused:
        return "triton"
    return "native" if native else "torch"


def _attention(name: str, cuda: bool, native: bool = False) -> str:
    if name == "auto":
        return "triton" if cuda else "native" if native else "torch"
    if name == "native" and not native:
        raise ConfigError("attention_backend='native' needs the native CPU kernels: a CPU, "
                          "float32, and native_kernels not False; use 'auto' or 'torch'")
    if name == "triton" and not _triton_runs(cuda):
        raise ConfigError(
            "attention_backend='triton' needs a CUDA GPU (on a CPU, Triton's interpreter: set "
            "TRITON_INTERPRET=1); use 'auto' or 'torch'"
        )
    return name


# (max_num_seqs, max_num_batched_tokens) when not given. A CPU's steps are bound by its
# matmuls: 64 rows and 2,048 tokens keep a step short. A GPU needs wide steps to run near its
# speed of light (bench.py's workload runs far slower on an H200 at the CPU's limits); a GPU
# under 40 GiB gets half, so the largest step's activations leave room for
# the KV cache.
CPU_STEP_LIMITS = (64, 2048)
GPU_STEP_LIMITS = (512, 16384)
SMALL_GPU_STEP_LIMITS = (256, 8192)
SMALL_GPU_GIB = 40


def _step_limits(config: EngineConfig, cuda: bool) -> tuple[int, int]:
    """max_num_seqs and max_num_batched_tokens: the ones given, the others for the device;
    a default never contradicts a given value (tokens >= rows)."""
    if not cuda:
        seqs, tokens = CPU_STEP_LIMITS
    elif torch.cuda.get_device_properties(0).total_memory >= SMALL_GPU_GIB * 2**30:
        seqs, tokens = GPU_STEP_LIMITS
    else:
        seqs, tokens = SMALL_GPU_STEP_LIMITS
    given_seqs, given_tokens = config.max_num_seqs, config.max_num_batched_tokens
    if given_seqs is not None and given_tokens is not None:
        return given_seqs, given_tokens
    if given_seqs is not None:
        return given_seqs, max(tokens, given_seqs)
    if given_tokens is not None:
        return min(seqs, given_tokens), given_tokens
    return seqs, tokens


def _check_tensor_parallel(size: int, device: str, model: ModelConfig) -> None:
    """The model must split evenly; one GPU per rank: on a GPU machine the local ranks need
    that many (a launcher that sets WORLD_SIZE places ranks itself, possibly over several
    hosts)."""
    check_shardable(model.num_attention_heads, model.num_key_value_heads,
                    model.intermediate_size, size)
    if size > 1 and device == "cuda" and "WORLD_SIZE" not in os.environ:
        have = torch.cuda.device_count()
        if have < size:
            raise ConfigError(
                f"tensor_parallel_size={size} needs {size} GPUs, one per rank; this machine "
                f"has {have}: use at most {have}, or device='cpu'"
            )


def _threads(config: EngineConfig, device: str) -> int | None:
    """CPU ranks share the cores: each takes its share unless num_threads says otherwise."""
    if config.num_threads is not None or device != "cpu" or config.tensor_parallel_size == 1:
        return config.num_threads
    return max(1, (os.cpu_count() or 1) // config.tensor_parallel_size)


def default_swap_gib(available: int | None) -> float:
    """swap_space on a GPU when none is given: GPU_SWAP_GIB, or a quarter of the host's
    available memory where that is less (a small host keeps room for everything else)."""
    if available is None:
        return GPU_SWAP_GIB
    return min(GPU_SWAP_GIB, available / 4 / 2**30)
