"""Compile the Triton kernels for an H100/H200 (sm_90) on a machine without a GPU, and report
what their PTX loads. Run as `python -m tests.model.sm90_ptx` (test_triton_ptx.py does),
never under TRITON_INTERPRET: the interpreter runs the kernels as Python and would not catch
what only the compiler rejects (an early `return` in a constexpr `if` compiles in the
interpreter and fails in Triton's code generator) nor how the loads are vectorized.

Each kernel is launched by its real launcher (store_kv, paged_attention) on CPU tensors with
the jitted kernel swapped for a recorder; each recorded launch is then compiled with the
signature Triton would give it on a GPU: pointers 16-byte aligned, integers equal to 1
folded and those divisible by 16 marked so (unless the kernel says do_not_specialize).
Prints one JSON object per compiled launch: kernel, case, the PTX's loads by kind and width,
its count of shared-memory stores, the shared memory it needs and, from the cubin (through
the cuobjdump Triton ships), its registers a thread and bytes spilled to local memory.
The fp8 cache's prefill reads the chunk's own positions from `fresh`, as an engine's does;
`--fresh` adds the prefill with `fresh` over the bf16 cache. `--dump DIR` also writes each
compiled launch's PTX, TTGIR (its loads' thread layouts) and cubin (SASS through
`cuobjdump -sass`) into DIR, numbered in launch order.
"""

import inspect
import json
import os
import re
import sys
from collections import Counter

import torch

# name: kv_cache_dtype - the cache's format and layout come from worker/kv_cache.py
CASES = {"bf16": "auto", "fp8": "fp8"}
# Qwen3-0.6B's attention: 16 query heads, 8 KV heads, head_dim 128, blocks of 256
HQ, HKV, D, BS = 16, 8, 128, 256
TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
         torch.uint8: "u8", torch.int32: "i32", torch.int64: "i64"}


class Recorder:
    """Stands in for a jitted kernel: `kernel[grid](*args, **kwargs)` records the call."""

    def __init__(self, fn, calls):
        self.fn, self.calls = fn, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.fn, args, kwargs))


def _signature(fn, args, kwargs):
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "launch_pdl")
               if k in kwargs}
    values = dict(zip(fn.arg_names, args)) | kwargs
    keep_generic = {n if isinstance(n, str) else fn.arg_names[n]
                    for n in fn.do_not_specialize or ()}
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name not in values:  # a constexpr left at its default, which the launch fills in
            default = fn.params[i].default
            if default is inspect.Parameter.empty:
                continue
            values[name] = default
        v = values[name]
        if fn.params[i].is_constexpr:
            sig[name], consts[(i,)] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[name] = "*" + TYPES[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            if v == 1 and name not in keep_generic:
                sig[name], consts[(i,)] = "constexpr", 1
            else:
                sig[name] = "i32" if -2**31 <= v < 2**31 else "i64"
                if v % 16 == 0 and name not in keep_generic:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: argument {name} of type {type(v).__name__}")
    return sig, consts, attrs, options


def record(kv_cache_dtype: str, fresh: bool | None = None) -> list:
    """The launches of a decoder layer's store and attention over the cache, in a mixed
    step; `fresh` (default: over an fp8 cache, as Kernels.fresh_prefill) passes the step's
    K/V to paged_attention."""
    import importlib

    from nanovllm.kernels.attention_metadata import AttentionMetadata
    from nanovllm.worker.kv_cache import KVFormat

    # fresh modules, each after those it imports from (the attention module re-exports the
    # store's store_kv and calls the decode's and prefill's launchers), their kernels
    # swapped for recorders
    ts, td, tp, tb = (importlib.reload(importlib.import_module(f"nanovllm.kernels.triton.{m}"))
                      for m in ("kv_store", "decode", "prefill", "attention"))
    fmt = KVFormat.of(kv_cache_dtype, torch.bfloat16, D)
    if fresh is None:
        fresh = fmt.dtype == torch.uint8
    calls = []
    for module, name in ((ts, "_store_kv_kernel"), (ts, "_rope_store_kernel"),
                         (td, "_decode_kernel"), (td, "_reduce_kernel"), (tp, "_prefill_kernel"),
                         (td, "_rank_kernel")):
        setattr(module, name, Recorder(getattr(module, name), calls))
    # a mixed step: two decode rows with long contexts (KV splits) and a prefill chunk
    rows = [(1, 3000), (1, 700), (300, 800)]
    tokens = sum(q for q, _ in rows)
    blocks = sum(-(-c // BS) for _, c in rows) + 2
    cache = [torch.zeros(blocks, BS, HKV, fmt.width, dtype=fmt.dtype) for _ in range(2)]
    if fmt.dtype == torch.uint8:  # an fp8 V cache is stored transposed, K head-major with
        # its scales in a plane (KVCache.bind)
        from nanovllm.kernels.torch_attention import scale_plane_view

        cache[1] = cache[1].view(blocks, HKV, fmt.width, BS).permute(0, 3, 1, 2)
        heads = cache[0].view(blocks, HKV, BS, fmt.width).permute(0, 2, 1, 3)
        cache[0] = scale_plane_view(heads, D)
    q = torch.zeros(tokens, HQ, D, dtype=torch.bfloat16)
    kv = torch.zeros(tokens, HKV, D, dtype=torch.bfloat16)
    starts = [0]
    for n, _ in rows:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(tokens, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        context_lens=torch.tensor([c for _, c in rows], dtype=torch.int32),
        block_tables=torch.zeros(len(rows), 16, dtype=torch.int32),
        max_query_len=max(n for n, _ in rows), max_context_len=max(c for _, c in rows),
        query_lens_host=[n for n, _ in rows], context_lens_host=[c for _, c in rows])
    tb.store_kv(kv, kv, *cache, meta.slot_mapping)
    # the decoder layer's fused launch: q, k and v as views into one qkv projection output
    qkv = torch.zeros(tokens, (HQ + 2 * HKV) * D, dtype=torch.bfloat16)
    q_, k_, v_ = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
    rope, norm = torch.zeros(4096, D // 2), torch.ones(D, dtype=torch.bfloat16)
    ts.qk_norm_rope_store(q_.view(tokens, HQ, D), k_.view(tokens, HKV, D),
                          v_.view(tokens, HKV, D), torch.zeros(tokens, dtype=torch.int64),
                          rope, rope, *cache, meta.slot_mapping, norm, norm)
    tb.paged_attention(q, *cache, meta, D**-0.5, fresh=(kv, kv) if fresh else None)
    for _, _, kwargs in calls:  # these bf16 queries would be on a GPU: its fp8 conversion
        if "FP8_ASM" in kwargs:
            kwargs["FP8_ASM"] = kwargs["FP8"]
    return calls


def record_sampler() -> list:
    """The one-pass sampler's two launches (kernels/triton/sampling.py) for 256 rows of
    a 152k vocabulary in bf16."""
    import importlib

    cdf = importlib.reload(importlib.import_module("nanovllm.kernels.triton.sampling"))
    calls = []
    cdf._tile_sums_kernel = Recorder(cdf._tile_sums_kernel, calls)
    cdf._draw_kernel = Recorder(cdf._draw_kernel, calls)
    cdf.sample_one_pass(torch.zeros(256, 151936, dtype=torch.bfloat16), torch.zeros(256), 1e-5)
    return calls


def record_split_k() -> list:
    """The split-K projection's launches (kernels/triton/linear.py) at each of its tiles, at
    Qwen3-0.6B's o_proj and down_proj shapes in bf16, as a GPU engine makes them."""
    import importlib

    tl_ = importlib.reload(importlib.import_module("nanovllm.kernels.triton.linear"))
    calls = []
    tl_._split_k_kernel = Recorder(tl_._split_k_kernel, calls)
    for rows, _ in tl_.TILES:
        for k in (2048, 3072):
            tl_.split_k_linear(torch.zeros(rows, k, dtype=torch.bfloat16),
                               torch.zeros(1024, k, dtype=torch.bfloat16))
    return calls


def record_small_gemms() -> list:
    """small_linear's launches (kernels/triton/linear.py) at each of its tiles, at
    Qwen3-0.6B's qkv_proj and gate_up_proj shapes in bf16, as a GPU engine makes them."""
    import importlib

    tl_ = importlib.reload(importlib.import_module("nanovllm.kernels.triton.linear"))
    calls = []
    tl_._split_k_kernel = Recorder(tl_._split_k_kernel, calls)
    for rows, _ in tl_.SMALL_TILES:
        for n in (4096, 6144):
            tl_.small_linear(torch.zeros(rows, 1024, dtype=torch.bfloat16),
                             torch.zeros(n, 1024, dtype=torch.bfloat16))
    return calls


def record_norms() -> list:
    """The RMSNorm kernel's launches (kernels/triton/ops.py) as a decode step of 256 rows
    makes them: alone, after a residual add, after a split-K projection's partials."""
    import importlib

    ops = importlib.reload(importlib.import_module("nanovllm.kernels.triton.ops"))
    calls = []
    ops._rms_norm_kernel = Recorder(ops._rms_norm_kernel, calls)
    x, r = (torch.zeros(256, 1024, dtype=torch.bfloat16) for _ in range(2))
    w = torch.ones(1024, dtype=torch.bfloat16)
    ops.rms_norm(x, w, 1e-6)
    ops.add_rms_norm(x, r, w, 1e-6)
    parts = ops.SplitK(torch.zeros(4, 256, 1024), torch.bfloat16)
    ops.add_rms_norm(parts, r, w, 1e-6)
    return calls


def _resources(cubin: bytes | None) -> dict:
    """Registers a thread and spill bytes of a compiled kernel, read by the cuobjdump that
    ships with Triton; {} where it or the cubin is missing."""
    import shutil
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    exe = tool if os.path.exists(tool) else shutil.which("cuobjdump")
    if not cubin or exe is None:
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([exe, "--dump-resource-usage", f.name], capture_output=True,
                              text=True).stdout
    regs = re.search(r"REG:(\d+)", text)
    stack = re.search(r"STACK:(\d+)", text)
    local = re.search(r"LOCAL:(\d+)", text)
    return {"regs": int(regs.group(1)) if regs else None,
            "spill_bytes": int(stack.group(1)) + int(local.group(1)) if stack and local else None}


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET=1: the point is the compiler")
    import triton

    try:  # Triton's compiler API (3.x): another one is reported, not taken for our error
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, compile
        target = GPUTarget("cuda", 90, 32)
    except (ImportError, TypeError) as e:
        print(json.dumps({"unsupported": f"triton {triton.__version__}: {e!r}"}))
        return
    dump = sys.argv[sys.argv.index("--dump") + 1] if "--dump" in sys.argv[1:] else None
    if dump:
        os.makedirs(dump, exist_ok=True)
    launches = [(case, call) for case, kv_dtype in CASES.items() for call in record(kv_dtype)]
    if "--fresh" in sys.argv[1:]:  # and the prefill with `fresh` over the bf16 cache
        launches += [("bf16-fresh", call) for call in record("auto", fresh=True)
                     if call[2].get("FRESH")]
    launches += [("sampler", call) for call in record_sampler()]
    launches += [("split-k", call) for call in record_split_k()]
    launches += [("norm", call) for call in record_norms()]
    launches += [("small-gemm", call) for call in record_small_gemms()]
    if "--pdl" in sys.argv[1:]:  # each kernel as programmatic dependent launch has it
        for _, (fn, _, kwargs) in launches:
            if "PDL" in fn.arg_names:
                kwargs.update(PDL=True, launch_pdl=True)
    for i, (case, (fn, args, kwargs)) in enumerate(launches):
        sig, consts, attrs, options = _signature(fn, args, dict(kwargs))
        out = {"kernel": fn.__name__, "case": case}
        try:
            src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
        except TypeError as e:
            print(json.dumps({"unsupported": f"triton {triton.__version__}: {e!r}"}))
            return
        try:
            compiled = compile(src, target=target, options=options)
            ptx = compiled.asm["ptx"]
            if dump:
                name = f"{dump}/{i:03d}-{case}-{fn.__name__}"
                for ext, mode in (("ptx", "w"), ("ttgir", "w"), ("cubin", "wb")):
                    with open(f"{name}.{ext}", mode) as f:
                        f.write(compiled.asm[ext])
        except Exception as e:  # noqa: BLE001 - reported, and the test fails on it
            out["error"] = f"{type(e).__name__}: {e}"[:2000]
        else:
            ops = r"(?:ld\.global|ld\.shared|cp\.async\.c[ag])[.\w]*"
            out["loads"] = Counter(re.findall(ops, ptx))
            out["stores"] = len(re.findall(r"st\.shared[.\w]*", ptx))
            out["global_stores"] = Counter(re.findall(r"st\.global[.\w]*", ptx))
            # Philox rounds and logarithms (none in the sampler's pass over the logits), fp8
            # pairs converted to float16, PDL waits
            out["ops"] = {op: len(re.findall(rf"\b{re.escape(op)}\b", ptx))
                          for op in ("mul.hi.u32", "lg2.approx.f32", "cvt.rn.f16x2.e4m3x2",
                                     "griddepcontrol.wait")}
            # global loads issued before the PDL wait (none: a predecessor may write them)
            wait = ptx.find("griddepcontrol.wait")
            out["loads_before_wait"] = len(re.findall(r"ld\.global", ptx[:max(wait, 0)]))
            # Hopper's warpgroup MMA against Ampere's warp MMA: which tensor-core path a dot took
            out["ops"]["wgmma"] = len(re.findall(r"wgmma\.mma_async", ptx))
            out["ops"]["mma.sync"] = len(re.findall(r"\bmma\.sync", ptx))
            # what a launch needs of an SM: shared memory (H100/H200: 227 KiB a block at
            # most) and, from ptxas, registers a thread and bytes spilled to local memory
            out["shared"] = compiled.metadata.shared
            out |= _resources(compiled.asm.get("cubin"))
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
