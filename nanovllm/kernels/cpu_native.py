"""The CPU's native kernels: cpu_native.c compiled with the system's C compiler on first use
and called through ctypes (ops and attention backend "native", the CPU default where a
compiler is found: engine/resolve.py).

On a CPU a decode step is a few hundred small torch ops per layer, each dispatched from
Python; for one token that dispatch, not the arithmetic, is most of a norm's, RoPE's or the
attention's time. Here each is one call. Same signatures and results as torch_ops.py and
torch_attention.py (the reference the tests hold them to); what this file does not cover
(other dtypes, an fp8 cache, a step with prompt tokens) it hands to the torch backend.

The library is built once per source, compiler and CPU into NANOVLLM_CACHE (default
~/.cache/nanovllm), with `-O3 -march=native` (plain `-O3` if the compiler refuses that).
`available()` says why it cannot be had; the engine then uses the torch kernels and says so.
"""

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from nanovllm.kernels import torch_attention, torch_ops
from nanovllm.kernels.attention_metadata import AttentionMetadata

SOURCE = Path(__file__).with_name("cpu_native.c")
# the first the compiler accepts; -fopenmp-simd: the C's `omp simd` reductions, no runtime
FLAGS = (["-O3", "-march=native", "-fopenmp-simd"], ["-O3", "-fopenmp-simd"], ["-O3"])
F32 = torch.float32
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
SIGNATURES = {  # C function -> argument types (pointers, int64 sizes and strides, floats)
    "rms_norm": [_P, _I, _P, _P, _I, _I, _I, _F],
    "add_rms_norm": [_P, _I, _P, _I, _P, _P, _I, _I, _I, _F],
    "qk_norm_rope": [_P, _I, _I, _P, _I, _I, _P, _P, _P, _I, _I, _I, _I, _I, _P, _P, _F],
    "silu_and_mul": [_P, _I, _P, _I, _I, _I],
    "store_kv": [_P, _I, _I, _P, _I, _I, _P, _P, _P, _I, _I, _I, _I],
    "decode_attention": [_P, _I, _I, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, _I, _I, _F, _I,
                         _I],
}


def cache_dir() -> Path:
    return Path(os.environ.get("NANOVLLM_CACHE") or Path.home() / ".cache" / "nanovllm")


def _cpu_key() -> str:
    """What `-march=native` compiles for: the machine and, on Linux, its CPU's flags."""
    key = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return key + line
    except OSError:
        pass
    return key


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")


@functools.lru_cache(maxsize=1)
def _load() -> tuple[ctypes.CDLL | None, str]:
    """(the library, "") or (None, why not)."""
    cc = _compiler()
    if cc is None:
        return None, "no C compiler found (set CC, or install cc/gcc/clang)"
    source = SOURCE.read_bytes()
    key = source + cc.encode() + repr(FLAGS).encode() + _cpu_key().encode()
    digest = hashlib.sha256(key).hexdigest()[:16]
    lib_path = cache_dir() / f"cpu_native-{digest}.so"
    if not lib_path.exists():
        try:
            error = _build(cc, lib_path)
        except OSError as e:  # an unwritable cache directory, a full disk
            error = f"cannot build into {lib_path.parent}: {e} (set NANOVLLM_CACHE)"
        if error:
            return None, error
    try:
        lib = ctypes.CDLL(str(lib_path))
    except OSError as e:  # e.g. a cache on a noexec mount
        return None, f"cannot load {lib_path}: {e} (set NANOVLLM_CACHE)"
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int if name in ("store_kv", "decode_attention") else None
    return lib, ""


def _build(cc: str, lib_path: Path) -> str:
    """Compile SOURCE into lib_path (written whole, then renamed: another process may be
    building it too); "" or what went wrong."""
    lib_path.parent.mkdir(parents=True, exist_ok=True)
    error = ""
    for flags in FLAGS:
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib_path.parent)
        os.close(fd)
        cmd = [cc, *flags, "-std=c11", "-shared", "-fPIC", "-o", tmp, str(SOURCE), "-lm"]
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as e:
            run, error = None, f"{' '.join(cmd)}: {e}"
        if run is not None and run.returncode == 0:
            os.replace(tmp, lib_path)
            return ""
        if run is not None:
            error = f"{' '.join(cmd)} failed: {run.stderr.strip()[-500:]}"
        os.unlink(tmp)
    return error


def available() -> str:
    """"" when the native kernels can run here, else why not."""
    return _load()[1]


def _lib() -> ctypes.CDLL:
    lib, why = _load()
    if lib is None:
        raise RuntimeError(f"the native CPU kernels are not available: {why}")
    return lib


def _rows_ok(*tensors: torch.Tensor) -> bool:
    """float32 on the CPU, the last dim contiguous: what the C functions take."""
    for t in tensors:
        if t.dtype != F32 or t.is_cuda or t.stride(-1) != 1:
            return False
    return True


# ---- ops: torch_ops.py's signatures ------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dim() != 2 or not _rows_ok(x, weight) or not weight.is_contiguous():
        return torch_ops.rms_norm(x, weight, eps)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _lib().rms_norm(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), out.stride(0),
                    x.shape[0], x.shape[1], eps)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual), the sum written into `residual` (as the Triton
    kernel does)."""
    if (x.dim() != 2 or x.shape != residual.shape or not _rows_ok(x, residual, weight)
            or not weight.is_contiguous()):
        return torch_ops.add_rms_norm(x, residual, weight, eps)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _lib().add_rms_norm(x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0),
                        weight.data_ptr(), out.data_ptr(), out.stride(0), x.shape[0],
                        x.shape[1], eps)
    return out, residual


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, q_weight: torch.Tensor | None = None,
                 k_weight: torch.Tensor | None = None, eps: float = 1e-6):
    """torch_ops.qk_norm_rope with `positions` and the [max_position, D / 2] tables, in place
    on q and k; returns (q, k)."""
    norms = () if q_weight is None else (q_weight, k_weight)
    if (positions is None or positions.dtype != torch.int64 or not positions.is_contiguous()
            or not _rows_ok(q, k, cos, sin, *norms) or cos.stride() != sin.stride()
            or 2 * cos.shape[-1] != q.shape[-1] or not all(w.is_contiguous() for w in norms)):
        return torch_ops.qk_norm_rope(q, k, positions, cos, sin, q_weight, k_weight, eps)
    _lib().qk_norm_rope(
        q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
        positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos.stride(0), q.shape[0],
        q.shape[1], k.shape[1], cos.shape[-1], norms[0].data_ptr() if norms else None,
        norms[1].data_ptr() if norms else None, eps)
    return q, k


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2 or not _rows_ok(x):
        return torch_ops.silu_and_mul(x)
    n = x.shape[1] // 2
    out = x.new_empty(x.shape[0], n)
    _lib().silu_and_mul(x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), x.shape[0], n)
    return out


# ---- attention: torch_attention.py's signatures ----------------------------------------


def _cache_ok(cache: torch.Tensor) -> bool:
    return cache.is_contiguous() and _rows_ok(cache)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    if (k.shape[0] == 0 or not (_cache_ok(k_cache) and _cache_ok(v_cache)) or not _rows_ok(k, v)
            or slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous()):
        return torch_attention.store_kv(k, v, k_cache, v_cache, slot_mapping)
    status = _lib().store_kv(
        k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1),
        k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(), k.shape[0], k.shape[1],
        k.shape[2], k_cache.shape[0] * k_cache.shape[1])
    if status:  # the torch backend would raise too: a bug upstream, never a silent write
        raise IndexError(f"store_kv: a slot of {slot_mapping.tolist()} lies outside the cache's "
                         f"{k_cache.shape[0] * k_cache.shape[1]} slots")


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float,
                    fresh: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Decode steps (one query token per row) natively; any other step as the torch
    backend does it (`fresh` there too)."""
    lens, tables = meta.context_lens, meta.block_tables
    decode = meta.max_query_len == 1 and q.shape[0] == len(meta.query_lens_host)
    if (not decode
            or not (_cache_ok(k_cache) and _cache_ok(v_cache)) or not _rows_ok(q)
            or lens.dtype != torch.int32 or not lens.is_contiguous()
            or tables.dtype != torch.int32 or tables.stride(-1) != 1):
        return torch_attention.paged_attention(q, k_cache, v_cache, meta, scale, fresh)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    status = _lib().decode_attention(
        q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
        tables.data_ptr(), tables.stride(0), lens.data_ptr(), out.data_ptr(), out.stride(0),
        out.stride(1), q.shape[0], q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1],
        scale, tables.shape[1], k_cache.shape[0])
    if status == -1:
        raise MemoryError("decode attention: no memory for its scores")
    if status:  # checked before any read: a bug upstream, never a read past the cache
        raise IndexError(f"decode attention: context lengths {lens.tolist()} do not fit block "
                         f"tables {tables.tolist()} over {k_cache.shape[0]} blocks")
    return out
