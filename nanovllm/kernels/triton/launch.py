"""How the Triton kernels of a step launch: as programmatic dependent launches (PDL, sm_90 and
later) where the GPU and Triton have them, over how many multiprocessors (`num_sms`).

A decode step is ~8 launches a layer, most of them a few microseconds long, so each one's
launch and ramp-up, and the tail of the one before it, are a large share of the step. With
PDL a kernel is launched with `launch_pdl`: the GPU may start its programs once every
program of the kernel before it has started (and passed its own wait), and each program
first waits (`griddepcontrol.wait`) until that kernel has finished and its writes are
visible, then lets the next kernel launch. Nothing is read or written before the wait, so
the order of the kernels' memory effects is the stream's. A kernel after a non-PDL one (a
cuBLAS matmul) simply starts when it ends, as before.

CPU tensors, the interpreter, GPUs before sm_90 and a Triton without dependent launches
(`triton_has_pdl`) launch the kernels plainly.
"""

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    # a kernel's first statement: wait for the kernel before it (finished, writes
    # visible), then allow the one after it to launch
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def pdl_launch(t: torch.Tensor) -> dict:
    """The launch arguments of a kernel over `t`'s device: `PDL` for the kernel's
    pdl_enter, and Triton's `launch_pdl` where both the device and this Triton have it."""
    on = t.is_cuda and triton_has_pdl() and _has_pdl(t.device)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@functools.lru_cache(maxsize=1)
def triton_has_pdl() -> bool:
    """Whether this Triton launches dependent kernels: its CUDA options have `launch_pdl`
    and its language `gdc_wait` (Triton 3.4 has both; torch 2.5's Triton 3.1 neither, and
    there the kernels launch as before)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    fields = getattr(CUDAOptions, "__dataclass_fields__", {})
    cuda = getattr(getattr(tl, "extra", None), "cuda", None)
    return "launch_pdl" in fields and hasattr(cuda, "gdc_wait") and hasattr(
        cuda, "gdc_launch_dependents")


@functools.lru_cache(maxsize=8)
def _has_pdl(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


@functools.lru_cache(maxsize=8)
def num_sms(device: torch.device) -> int:
    """The GPU's multiprocessors, which the decode's splits and the split-K GEMM fill."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # interpreter runs: pretend an H100/H200 so the split logic is exercised
