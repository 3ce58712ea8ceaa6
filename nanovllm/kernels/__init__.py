"""The kernels a model runs, chosen once per engine: no module globals decide them.

Every operation has a plain-torch implementation (`torch_ops`, `torch_attention`: the
reference, and the CPU path where no C compiler is found) and a Triton one (`triton/ops.py`,
`triton/attention.py`, `triton/sampling.py`: the CUDA path, also run by tests in Triton's CPU
interpreter). On a CPU the small ops and decode attention run in C (`cpu_native`, built on
first use).

An engine resolves its settings (EngineConfig.fused_kernels, native_kernels,
attention_backend) into one `Kernels` and passes it to the model when it is built, so two
engines in one process run what each asked for. Triton modules are imported only when
chosen: a CPU install without triton never loads them.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass

# norms, RoPE, SiLU (and the one-pass sampler)
OPS = ("triton", "native", "torch")
ATTENTION = ("triton", "native", "torch")  # paged attention and the K/V store


@dataclass(frozen=True)
class Kernels:
    """One engine's choice of kernels, as the callables the layers call."""

    ops: str  # one of OPS
    attention: str  # one of ATTENTION
    rms_norm: Callable
    add_rms_norm: Callable  # the Triton one updates `residual` in place (triton/ops.py)
    qk_norm_rope: Callable  # the Triton one works in place on q and k
    silu_and_mul: Callable
    store_kv: Callable
    paged_attention: Callable
    # greedy / plain-temperature batches sampled in one pass over the logits; None: torch
    sample_one_pass: Callable | None
    # qk_norm_rope then store_kv in one launch (Triton ops and attention); None: two calls
    qk_norm_rope_store: Callable | None = None
    # the projections that feed a residual-add RMSNorm (o_proj, down_proj), at few rows, as
    # split-K partial products that add_rms_norm sums (triton/linear.py; Triton ops only);
    # None: their plain matmul
    split_k_linear: Callable | None = None
    # Attention passes each step's K/V to paged_attention as `fresh`, so an fp8 cache's
    # prefill rows read their own chunk as computed, unrounded (a cache of the model's dtype
    # holds those values already)
    fresh_prefill: bool = False
    # qkv_proj and gate_up_proj at few rows by a Triton launch (triton.linear.small_linear,
    # bound with split_k; None from it, the plain matmul: more rows)
    small_linear: Callable | None = None


@functools.cache  # equal choices share callables (and compiled graphs)
def select_kernels(ops: str = "torch", attention: str = "torch", split_k: bool = False,
                   fresh_prefill: bool = False) -> Kernels:
    """The kernels for `ops` (one of OPS) and `attention` (one of ATTENTION); `split_k`
    (Triton ops only): the split-K projections of triton/linear.py (and its small_linear);
    `fresh_prefill`: see Kernels.fresh_prefill."""
    if ops not in OPS or attention not in ATTENTION:
        raise ValueError(f"unknown kernels ops={ops!r} attention={attention!r}")
    if split_k and ops != "triton":
        raise ValueError("split_k needs ops='triton': only its add_rms_norm sums the partials")
    if attention == "triton":
        from nanovllm.kernels.triton import attention as attn
    elif attention == "native":
        from nanovllm.kernels import cpu_native as attn
    else:
        from nanovllm.kernels import torch_attention as attn
    one_pass = None
    if ops == "triton":
        from nanovllm.kernels.triton import ops as impl
        from nanovllm.kernels.triton.sampling import sample_one_pass as one_pass
    elif ops == "native":
        from nanovllm.kernels import cpu_native as impl
    else:
        from nanovllm.kernels import torch_ops as impl
    fns = [impl.rms_norm, impl.add_rms_norm, impl.qk_norm_rope, impl.silu_and_mul]
    fused_store = None
    if ops == "triton" and attention == "triton":
        from nanovllm.kernels.triton.kv_store import qk_norm_rope_store as fused_store
    split_k_linear = small_linear = None
    if split_k:
        from nanovllm.kernels.triton.linear import small_linear, split_k_linear
    return Kernels(ops, attention, *fns, attn.store_kv, attn.paged_attention, one_pass,
                   fused_store, split_k_linear, fresh_prefill, small_linear)
