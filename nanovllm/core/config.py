"""Engine settings: what a user asks for (EngineConfig) and what the engine runs with once
every automatic choice is made for the device and model (ResolvedConfig, built by
engine/resolve.py and read by every part, never written)."""

from dataclasses import dataclass, fields

from nanovllm.core.errors import ConfigError

POLICIES = ("fair", "prefill_first")
PREEMPTION_MODES = ("auto", "swap", "recompute")
ALL_REDUCES = ("nccl", "symm_mem")


@dataclass(frozen=True)
class EngineConfig:
    """Everything `LLM(model, **config)` accepts besides the model path. None and "auto"
    mean: chosen for the device and model at start-up (see ResolvedConfig)."""

    # most tokens and sequences in one step. None: chosen for the device (engine/resolve.py):
    # 2,048 and 64 on a CPU; 16,384 and 512 on a GPU with 40 GiB or more (8,192 and 256 on a
    # smaller one), max_num_seqs then capped at the KV cache's blocks
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None  # None: the model's context, or what the KV cache holds
    # tokens per KV cache block (a power of two). None: 16, or 128 for an fp8 cache read by
    # the Triton kernels, whose tiles of a transposed fp8 V stay within one block
    # (engine/resolve.py; BENCHMARKS.md: 1.54x the seed workload's speed over 16)
    block_size: int | None = None
    num_kv_blocks: int | None = None  # None: sized from kv_cache_gib / gpu_memory_utilization
    kv_cache_gib: float | None = None  # CPU default 2 GiB
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fair"
    # fair: admit new prompts only once this many rows are free (or as many as are waiting),
    # so one prefill+decode step admits several; such steps run eagerly (unless
    # mixed_graphs), decode-only ones as CUDA graphs. 1 admits at once. Never held back
    # longer than admission_max_delay steps.
    # None: 16 on a GPU with CUDA graphs (capped at max_num_seqs), else 1 (see BENCHMARKS).
    admission_batch: int | None = None
    admission_max_delay: int = 16
    # fair: a prompt is admitted only while its whole remaining prompt plus the next
    # admission_headroom tokens of every running sequence fit in the free KV blocks, so a
    # burst queues instead of forcing preemptions a few steps later. 0: admit whenever the
    # first chunk fits.
    admission_headroom: int = 8
    # KV beyond the device (docs/architecture.md, "KV tiers"): GiB of host memory for the
    # blocks of preempted sequences (swap_space) and for cached prefixes evicted from the
    # device (cpu_offload_gib). None: 4 GiB of swap on a GPU (at most a quarter of the
    # host's available memory), none on a CPU.
    swap_space: float | None = None
    cpu_offload_gib: float = 0.0
    # how a preempted sequence keeps its work: auto (swap when copying its blocks out and
    # back costs less than recomputing them) | swap | recompute
    preemption_mode: str = "auto"
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    # auto: the model's dtype | fp8: float8 e4m3, half a bf16 cache's bytes (KVFormat in
    # worker/kv_cache.py). kv_cache_scales: token (a scale per token and head, its amax /
    # 448) | tensor (one static scale of 1). Both attention backends read it.
    kv_cache_dtype: str = "auto"
    kv_cache_scales: str = "token"
    # fp8 cache: attention (prefill and decode) on the fp8 tensor cores with q (and, "qp", P)
    # quantized to e4m3 (kernels/triton_fp8_decode.py) | off: K and V converted to float16.
    # Off until a GPU measures its gain; what its numerics cost is in BENCHMARKS.md
    fp8_attention: str = "off"
    device: str = "auto"  # auto | cpu | cuda
    enforce_eager: bool = False  # no CUDA graphs
    # CUDA graphs for prefill+decode steps too, over a ladder of token counts up to
    # MIXED_GRAPH_MAX_TOKENS (worker/cuda_graph.py); needs CUDA graphs and the Triton
    # attention (whose launches read the step's lengths on the device). Off by default until
    # a benchmark shows its gain (BENCHMARKS.md: none offline, none saturated serving)
    mixed_graphs: bool = False
    # Triton norms/RoPE/SiLU and one-pass sampler. None: on CUDA. True on a CPU needs
    # Triton's interpreter (TRITON_INTERPRET=1; tests). Takes precedence over torch_compile.
    fused_kernels: bool | None = None
    # o_proj and down_proj at up to 256 rows as a split-K Triton GEMM whose fp32 partials the
    # next residual-add RMSNorm sums (kernels/triton_linear.py): 1.1-1.6x on those two
    # projections on the H200. Needs the fused kernels; not under tensor parallelism.
    # None: on with the fused kernels on a GPU, one rank
    split_k: bool | None = None
    torch_compile: bool = False  # fuse norms/RoPE/SiLU with torch.compile (see BENCHMARKS)
    # CPU: norms, RoPE, SiLU, the K/V store and decode attention in C (kernels/cpu_native.c,
    # built with the system's C compiler on first use). None: on a CPU in float32 where a
    # compiler is found (else the torch kernels, said at start-up); True: required
    native_kernels: bool | None = None
    # auto (triton on CUDA; on a CPU native with native_kernels, else torch) | triton |
    # native | torch
    attention_backend: str = "auto"
    overlap: bool | None = None  # schedule step N+1 while the GPU runs step N (None: on GPU)
    seed: int = 0
    # CPU: torch intra-op threads, fixed. None: torch's default, fewer while other processes
    # take cores (worker/cpu_threads.py)
    num_threads: int | None = None
    # how a GGUF file's 4/8-bit weights run on a CPU: int4 (kept quantized: torch's int4 /
    # int8 CPU kernels) | int4-bf16 (int4, plus a bfloat16 copy of the 4-bit projections
    # for prefill steps: ~1.8x faster prompts, ~200 MB more) | dense (dequantized to dtype).
    # auto: int4-bf16 on a CPU, dense on a GPU (see BENCHMARKS.md)
    weight_format: str = "auto"
    trace: str | None = None  # a file to record every step to (core/trace.py)
    # publish KV cache events (blocks stored / removed per tier) in vLLM's ZMQ + msgpack
    # format on this address, e.g. "tcp://*:5557" (engine/kv_events.py); None: off
    kv_events_endpoint: str | None = None
    kv_events_topic: str = ""
    # shard the model over this many ranks (GPUs, or CPU processes), one process each; rank
    # 0 is the engine's own process (worker/tensor_parallel.py)
    tensor_parallel_size: int = 1
    # the all-reduce of tensor parallelism on GPUs: nccl, or symm_mem (one kernel that sums
    # every rank's copy over peer memory, torch.distributed's symmetric memory, for tensors
    # up to 8 MiB; larger ones go to NCCL). Off until benchmarks/tensor_parallel.py measures it
    all_reduce: str = "nccl"

    @classmethod
    def from_options(cls, **options) -> "EngineConfig":
        """An EngineConfig from keyword options, naming any it does not know."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"unknown engine option(s) {unknown}; valid options: {sorted(known)}")
        return cls(**options)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> None:
            raise ConfigError(f"{name}={getattr(self, name)!r} is invalid: {why}")

        if self.scheduling_policy not in POLICIES:
            bad("scheduling_policy", f"choose one of {', '.join(POLICIES)}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            bad("max_num_seqs", "use an integer >= 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            bad("max_num_batched_tokens", "use an integer >= 1")
        if self.tensor_parallel_size < 1:
            bad("tensor_parallel_size", "use an integer >= 1 (1: one device, no sharding)")
        if self.all_reduce not in ALL_REDUCES:
            bad("all_reduce", f"choose one of {', '.join(ALL_REDUCES)}")
        if self.admission_batch is not None and not 1 <= self.admission_batch <= (
                self.max_num_seqs or self.admission_batch):
            bad("admission_batch", f"use an integer in [1, max_num_seqs={self.max_num_seqs}]")
        if self.admission_batch is not None and self.admission_batch < 1:
            bad("admission_batch", "use an integer >= 1")
        if self.admission_max_delay < 0:
            bad("admission_max_delay", "use a number of steps >= 0")
        if self.admission_headroom < 0:
            bad("admission_headroom", "use a number of tokens >= 0")
        if self.swap_space is not None and self.swap_space < 0:
            bad("swap_space", "use a size in GiB >= 0")
        if self.cpu_offload_gib < 0:
            bad("cpu_offload_gib", "use a size in GiB >= 0")
        if self.preemption_mode not in PREEMPTION_MODES:
            bad("preemption_mode", f"choose one of {', '.join(PREEMPTION_MODES)}")
        if self.preemption_mode == "swap" and self.swap_space == 0:
            bad("preemption_mode", "swapping needs swap_space > 0 (GiB of host memory)")
        if not self.enable_prefix_caching and (self.swap_space or self.cpu_offload_gib):
            raise ConfigError(
                "swap_space and cpu_offload_gib need enable_prefix_caching=True: the host "
                "tier finds blocks by their content hash"
            )
        if (self.max_num_batched_tokens is not None and self.max_num_seqs is not None
                and self.max_num_batched_tokens < self.max_num_seqs):
            bad(
                "max_num_batched_tokens",
                f"it must be >= max_num_seqs={self.max_num_seqs} so every running "
                "sequence can decode each step",
            )
        if self.block_size is not None and (
                self.block_size < 1 or self.block_size & (self.block_size - 1)):
            bad("block_size", "use a power of two such as 16")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            bad("num_kv_blocks", "use a positive integer, or leave it unset to size it from memory")
        if self.kv_cache_gib is not None and self.kv_cache_gib <= 0:
            bad("kv_cache_gib", "use a positive size in GiB")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            bad("gpu_memory_utilization", "use a fraction in (0, 1]")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            bad("dtype", "choose auto, float32, bfloat16 or float16")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            bad("kv_cache_dtype", "choose auto (the model's dtype) or fp8")
        if self.kv_cache_scales not in ("token", "tensor"):
            bad("kv_cache_scales", "choose token or tensor")
        if self.fp8_attention not in ("off", "q", "qp"):
            bad("fp8_attention", "choose off, q or qp")
        if self.fp8_attention != "off" and self.kv_cache_dtype != "fp8":
            bad("fp8_attention", "it reads an fp8 KV cache: set kv_cache_dtype='fp8' too")
        if self.device not in ("auto", "cpu", "cuda"):
            bad("device", "choose auto, cpu or cuda")
        if self.attention_backend not in ("auto", "triton", "native", "torch"):
            bad("attention_backend", "choose auto, triton, native or torch")
        if self.max_model_len is not None and self.max_model_len < 1:
            bad("max_model_len", "use a positive integer")
        if self.weight_format not in ("auto", "int4", "int4-bf16", "dense"):
            bad("weight_format", "choose auto, int4, int4-bf16 or dense")


@dataclass(frozen=True)
class ResolvedConfig:
    """The settings one engine runs with: an EngineConfig with every automatic value chosen
    for the device and model. Logged at start-up in one line (`summary`)."""

    device: str  # "cpu" | "cuda"
    dtype: str  # "float32" | "bfloat16" | "float16"
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_kv_blocks: int | None  # None until the KV cache is sized (engine/resolve.py)
    kv_cache_gib: float | None
    gpu_memory_utilization: float
    enable_prefix_caching: bool
    scheduling_policy: str
    admission_batch: int
    admission_max_delay: int
    cuda_graphs: bool
    overlap: bool
    kernels: str  # norms/RoPE/SiLU/sampler: "triton" | "native" | "torch" | "compiled"
    attention_backend: str  # "triton" | "native" | "torch"
    seed: int
    num_threads: int | None
    weight_format: str = "dense"  # "int4" | "int4-bf16" | "dense"
    admission_headroom: int = 0
    swap_space: float = 0.0
    cpu_offload_gib: float = 0.0
    preemption_mode: str = "auto"
    num_host_blocks: int = 0  # swap_space + cpu_offload_gib in blocks, once the cache is sized
    tensor_parallel_size: int = 1
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype) | "fp8"
    kv_cache_scales: str = "token"  # fp8: "token" | "tensor"
    fp8_attention: str = "off"  # fp8: "off" | "q" | "qp"
    mixed_graphs: bool = False  # prefill+decode steps replay CUDA graphs too
    split_k: bool = False  # o_proj / down_proj of few rows as split-K partials
    all_reduce: str = "nccl"  # tensor parallelism on GPUs: "nccl" | "symm_mem"

    @property
    def kv_cache_tokens(self) -> int:
        return (self.num_kv_blocks or 0) * self.block_size

    def summary(self) -> str:
        """One line: what this engine runs with."""
        return (
            f"device={self.device} dtype={self.dtype} max_model_len={self.max_model_len} "
            f"max_num_seqs={self.max_num_seqs} "
            f"max_num_batched_tokens={self.max_num_batched_tokens} "
            f"kv_cache={self.num_kv_blocks}x{self.block_size} tokens "
            + (f"({self.kv_cache_dtype}, scales per {self.kv_cache_scales}"
               + (f", fp8 attention {self.fp8_attention}" if self.fp8_attention != "off"
                  else "") + ") " if self.kv_cache_dtype != "auto" else "")
            + f"prefix_caching={_on(self.enable_prefix_caching)} "
            f"policy={self.scheduling_policy} admission_batch={self.admission_batch} "
            f"cuda_graphs={_on(self.cuda_graphs)}"
            + (" (mixed steps too)" if self.mixed_graphs else "")
            + f" overlap={_on(self.overlap)} "
            f"kernels={self.kernels}{' (split-K projections)' if self.split_k else ''} "
            f"attention={self.attention_backend} "
            f"weights={self.weight_format} headroom={self.admission_headroom} "
            f"host_kv={self.num_host_blocks}x{self.block_size} tokens "
            f"(swap {self.swap_space:g} GiB, offload {self.cpu_offload_gib:g} GiB, "
            f"preemption={self.preemption_mode})"
            + (f" tensor_parallel={self.tensor_parallel_size}"
               + (f" (all-reduce {self.all_reduce})" if self.device == "cuda" else "")
               if self.tensor_parallel_size > 1 else "")
        )


def _on(flag: bool) -> str:
    return "on" if flag else "off"
