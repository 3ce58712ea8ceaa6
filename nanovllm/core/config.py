"""Engine settings: what a user asks for (EngineConfig) and what the engine runs with once
every automatic choice is made for the device and model (ResolvedConfig, built by
engine/resolve.py and read by every part, never written).

Each option is described once, on its field: the CLI's flags and `--help` are generated from
these fields (entrypoints/cli/arguments.py), so the help here is the reference."""

from dataclasses import dataclass, field, fields

from nanovllm.core.errors import ConfigError

POLICIES = ("fair", "prefill_first")
REASONING_PARSERS = ("qwen3", "deepseek_r1")  # engine/reasoning.py
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json")  # engine/tool_calls.py


def option(default, help: str, *, choices: tuple = (), flags: tuple = (), metavar: str = ""):
    """A field of EngineConfig: its default, its help (the CLI's too), the values it takes
    (checked by EngineConfig, shown by --help), and its flags when not the field's name in
    dashes (vLLM's first where it has one)."""
    return field(default=default, metadata=dict(help=help, choices=choices, flags=flags,
                                                metavar=metavar))


@dataclass(frozen=True)
class EngineConfig:
    """Everything `LLM(model, **config)` accepts besides the model path. None and "auto"
    mean: chosen for the device and model at start-up (see engine/resolve.py)."""

    dtype: str = option(
        "auto", "weights and activations; auto: float32 on a CPU, the checkpoint's half "
        "precision on a GPU", choices=("auto", "float32", "bfloat16", "float16"))
    device: str = option("auto", "auto: cuda when a GPU is visible",
                         choices=("auto", "cpu", "cuda"))
    kv_cache_dtype: str = option(
        "auto", "KV cache storage; fp8: float8 e4m3 with a scale per token and head, about "
        "half a bf16 cache's memory and faster on a GPU, its tokens within fp8 rounding of a "
        "bf16 cache's; auto: the model's dtype", choices=("auto", "fp8"))
    max_model_len: int | None = option(
        None, "longest sequence, prompt and output together (default: the model's context, or "
        "what the KV cache holds if less)", metavar="N")
    max_num_seqs: int | None = option(
        None, "most sequences in one step (default: 64 on a CPU; on a GPU 512, 256 under 40 "
        "GiB, at most the KV cache's blocks)", metavar="N")
    max_num_batched_tokens: int | None = option(
        None, "most tokens in one step (default: 2048 on a CPU; on a GPU 16384, 8192 under 40 "
        "GiB)", metavar="N")
    block_size: int | None = option(
        None, "tokens per KV cache block, a power of two (default: 16; 128 for an fp8 cache on "
        "a GPU, whose attention tiles lie in one block)", metavar="N")
    num_kv_blocks: int | None = option(
        None, "KV cache blocks (default: sized from --kv-cache-gib or "
        "--gpu-memory-utilization)", flags=("--num-kv-blocks", "--num-gpu-blocks-override"),
        metavar="N")
    kv_cache_gib: float | None = option(
        None, "KV cache size in GiB (default: 2 on a CPU; on a GPU what "
        "--gpu-memory-utilization leaves)", metavar="GIB")
    gpu_memory_utilization: float = option(
        0.9, "GPU: fraction of its memory for weights, activations and the KV cache",
        metavar="FRACTION")
    enable_prefix_caching: bool = option(
        True, "reuse the KV cache of shared prompt prefixes (content-hashed blocks)")
    scheduling_policy: str = option(
        "fair", "fair: decodes and prefill chunks share each step, so no decode waits for a "
        "prompt; prefill_first: a step is all prefill or all decode", choices=POLICIES)
    admission_batch: int | None = option(
        None, "fair policy: admit new prompts once this many rows are free (or as many as "
        "wait), so one mixed step admits several (default: 16 on a GPU with CUDA graphs, "
        "where mixed steps run eagerly; else 1: at once)", metavar="N")
    admission_max_delay: int = option(
        16, "most steps a prompt is held back for --admission-batch", metavar="STEPS")
    admission_headroom: int = option(
        8, "fair policy: admit a prompt only while it and the next TOKENS tokens of every "
        "running sequence fit in the free KV blocks, so a burst queues instead of forcing "
        "preemptions (0: whenever its first chunk fits)", metavar="TOKENS")
    swap_space: float | None = option(
        None, "host memory for the KV blocks of preempted sequences, copied back when they "
        "resume (default: 4 on a GPU, at most a quarter of the host's available memory; 0 "
        "on a CPU)", metavar="GIB")
    cpu_offload_gib: float = option(
        0.0, "host memory for cached prefixes evicted from the KV cache, copied back on a hit",
        metavar="GIB")
    preemption_mode: str = option(
        "auto", "how a preempted sequence keeps its work; auto: swap when copying its blocks "
        "costs less than recomputing them", choices=("auto", "swap", "recompute"))
    enforce_eager: bool = option(
        False, "GPU: no CUDA graphs (faster start-up, slower decode steps)")
    overlap: bool | None = option(
        None, "schedule step N+1 while the device runs step N (default: on with CUDA; on a "
        "CPU a step runs as it is launched, so there it would only delay outputs a step)")
    fused_kernels: bool | None = option(
        None, "Triton norms, RoPE, SiLU, one-pass sampler and split-K projections (default: "
        "on with CUDA; on a CPU they need Triton's interpreter, TRITON_INTERPRET=1: tests)")
    native_kernels: bool | None = option(
        None, "CPU: norms, RoPE, SiLU, the K/V store and decode attention in C, built with "
        "the system's C compiler on first use (default: on a CPU in float32 where one is "
        "found; on: required)")
    attention_backend: str = option(
        "auto", "attention kernels; torch is the reference the others are tested against; "
        "auto: triton on CUDA, native with the native CPU kernels, else torch",
        choices=("auto", "triton", "native", "torch"))
    seed: int = option(0, "seeds the sampling of requests that set no seed of their own",
                       flags=("--engine-seed",), metavar="N")
    num_threads: int | None = option(
        None, "CPU: torch threads, fixed (default: torch's choice, fewer while other "
        "processes take cores)", flags=("--num-threads", "--threads"), metavar="N")
    weight_format: str = option(
        "auto", "a GGUF file's 4/8-bit weights on a CPU: int4 (kept quantized, least memory), "
        "int4-bf16 (int4, plus a bfloat16 copy for prefill: faster prompts, ~200 MB more) or "
        "dense (dequantized to --dtype: exact float32 arithmetic); auto: int4-bf16 on a CPU, "
        "dense on a GPU", choices=("auto", "int4", "int4-bf16", "dense"))
    trace: str | None = option(
        None, "record every step to FILE (JSON lines; render with `nanovllm trace FILE`; "
        "default: no trace)", metavar="FILE")
    kv_events_endpoint: str | None = option(
        None, "publish KV cache events (blocks stored / removed, by tier) for KV-aware "
        "routers in vLLM's ZMQ + msgpack format on ADDRESS, e.g. tcp://*:5557 (default: off)",
        metavar="ADDRESS")
    kv_events_topic: str = option("", "the ZMQ topic of those events (default: empty)",
                                  metavar="TOPIC")
    reasoning_parser: str | None = option(
        None, "split a reasoning model's <think>...</think> from its answer into "
        "reasoning_content; structured output and tool calls then constrain the answer only "
        "(qwen3: Qwen3 and its kin; deepseek_r1: templates that open <think> in the prompt; "
        "default: off, the reasoning stays in the text)", choices=REASONING_PARSERS)
    tool_call_parser: str = option(
        "auto", "how the model writes tool calls, for tool_choice auto (hermes: "
        "<tool_call>{json}</tool_call>, as Qwen2.5 and Qwen3 write them; llama3_json: Llama "
        "3's bare JSON); auto: read from the chat template", choices=TOOL_CALL_PARSERS)
    tensor_parallel_size: int = option(
        1, "shard the model over N ranks, one process each: GPUs, or CPU processes; under "
        "torchrun or Slurm (WORLD_SIZE set) the other ranks run `nanovllm worker`",
        flags=("--tensor-parallel-size", "-tp"), metavar="N")

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

        for f in fields(self):
            choices = f.metadata["choices"]
            value = getattr(self, f.name)
            if choices and value not in choices and not (value is None and f.default is None):
                bad(f.name, f"choose one of {', '.join(choices)}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size",
                     "max_model_len"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                bad(name, "use an integer >= 1")
        if self.admission_batch is not None and not 1 <= self.admission_batch <= (
                self.max_num_seqs or self.admission_batch):
            bad("admission_batch", f"use an integer in [1, max_num_seqs={self.max_num_seqs}]")
        if self.admission_max_delay < 0:
            bad("admission_max_delay", "use a number of steps >= 0")
        if self.admission_headroom < 0:
            bad("admission_headroom", "use a number of tokens >= 0")
        if self.swap_space is not None and self.swap_space < 0:
            bad("swap_space", "use a size in GiB >= 0")
        if self.cpu_offload_gib < 0:
            bad("cpu_offload_gib", "use a size in GiB >= 0")
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


@dataclass(frozen=True)
class ResolvedConfig:
    """The settings one engine runs with: the options resolution decides for the device and
    model, over the EngineConfig it was resolved from (`asked`), whose every other option
    reads through (`resolved.seed` is `resolved.asked.seed`). Logged at start-up in one line
    (`summary`)."""

    asked: EngineConfig
    device: str  # "cpu" | "cuda"
    dtype: str  # "float32" | "bfloat16" | "float16"
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    admission_batch: int
    cuda_graphs: bool
    overlap: bool
    kernels: str  # norms/RoPE/SiLU/sampler: "triton" | "native" | "torch"
    attention_backend: str  # "triton" | "native" | "torch"
    num_threads: int | None
    weight_format: str = "dense"  # "int4" | "int4-bf16" | "dense"
    swap_space: float = 0.0
    split_k: bool = False  # o_proj / down_proj of few rows as split-K partials
    num_kv_blocks: int | None = None  # as asked (None: sized from memory) until fit_kv_cache
    num_host_blocks: int = 0  # swap_space + cpu_offload_gib in blocks, once the cache is sized

    def __getattr__(self, name: str):
        # only reached for names that are not fields: the options resolution leaves as asked
        if name.startswith("__") or name == "asked":
            raise AttributeError(name)
        return getattr(self.asked, name)

    def as_dict(self) -> dict:
        """Every option as the engine runs it, flat: the asked ones, the resolved over them."""
        flat = {f.name: getattr(self.asked, f.name) for f in fields(self.asked)}
        return flat | {f.name: getattr(self, f.name) for f in fields(self) if f.name != "asked"}

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
            + (f"({self.kv_cache_dtype}) " if self.kv_cache_dtype != "auto" else "")
            + f"prefix_caching={_on(self.enable_prefix_caching)} "
            f"policy={self.scheduling_policy} admission_batch={self.admission_batch} "
            f"cuda_graphs={_on(self.cuda_graphs)} overlap={_on(self.overlap)} "
            f"kernels={self.kernels}{' (split-K projections)' if self.split_k else ''} "
            f"attention={self.attention_backend} "
            f"weights={self.weight_format} headroom={self.admission_headroom} "
            f"host_kv={self.num_host_blocks}x{self.block_size} tokens "
            f"(swap {self.swap_space:g} GiB, offload {self.cpu_offload_gib:g} GiB, "
            f"preemption={self.preemption_mode})"
            + (f" tensor_parallel={self.tensor_parallel_size}"
               if self.tensor_parallel_size > 1 else "")
        )


def _on(flag: bool) -> str:
    return "on" if flag else "off"
