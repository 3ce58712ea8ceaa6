"""The attention kernels compile for sm_90 (H100/H200) on this CPU machine, for a bf16 cache and
an fp8 one in the GPU's layout, and their K/V tiles load in vectors, not bytes
(tests/model/sm90_ptx.py); the one-pass sampler compiles with no noise arithmetic in its pass
over the logits, the split-K projection at each of its tiles on the tensor cores without
spilling. The interpreter tests check what the kernels compute; this checks what only the
compiler sees: code it rejects and loads it cannot vectorize (an fp8 row of head_dim + 4 bytes
made the decode kernel load 128 single bytes per tile and ran the seed workload at 2,016
tok/s)."""

import json
import os
import subprocess
import sys

import pytest

from tests.support import triton_module

triton_module("triton")


STORES = ("_store_kv_kernel", "_rope_store_kernel")  # one token a program, K/V to the cache


def test_attention_kernels_compile_for_sm90_with_vector_loads():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "tests.model.sm90_ptx", "--fresh"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    if results and "unsupported" in results[-1]:
        pytest.skip(f"this Triton's compiler API is not the one sm90_ptx.py drives: "
                    f"{results[-1]['unsupported']}")
    compiled = {(r["kernel"], r["case"]) for r in results}
    for case in ("bf16", "fp8"):  # (the fp8 cache's prefill with `fresh`, as an engine's)
        for kernel in ("_store_kv_kernel", "_rope_store_kernel", "_decode_kernel",
                       "_reduce_kernel", "_prefill_kernel", "_rank_kernel"):
            assert (kernel, case) in compiled, f"{kernel} was not launched for {case}"
    assert ("_prefill_kernel", "bf16-fresh") in compiled, "the prefill with `fresh` over bf16"
    for kernel in ("_tile_sums_kernel", "_draw_kernel"):
        assert (kernel, "sampler") in compiled, f"{kernel} was not launched"
    assert ("_split_k_kernel", "split-k") in compiled
    errors = [f"{r['kernel']} ({r['case']}): {r['error']}" for r in results if "error" in r]
    assert not errors, "\n".join(errors)
    for r in results:
        # no tile loaded a byte at a time (128 byte loads a tile, when it was); but the
        # store, one token a program, may pass the 4 bytes of each head's scale through
        # shared memory when it writes them as rows of a V cache stored transposed, and a
        # tile of 128 positions over 128 threads loads each position's scale from those 4
        # rows a byte each (4 loads a loop over tiles)
        byte_loads = sum(n for op, n in r["loads"].items()
                         if op.endswith((".b8", ".u8", ".s8"))
                         and not (r["kernel"] in STORES and "shared" in op))
        allowed = 4 if r["case"] == "fp8" and r["kernel"] not in STORES else 0
        if r["kernel"] == "_prefill_kernel":  # its two loops (unmasked tiles, diagonal ones)
            allowed *= 2
        assert byte_loads <= allowed, f"{r['kernel']} ({r['case']}) loads bytes: {r['loads']}"
        if r["kernel"] in ("_decode_kernel", "_prefill_kernel"):
            # the tiles are pipelined through shared memory with 16-byte async copies
            assert r["loads"].get("cp.async.cg.shared.global", 0) > 0, r
        if r["kernel"] == "_decode_kernel" and r["case"] == "fp8":
            # an fp8 decode tile crosses shared memory once, as bytes, and is converted in
            # registers: as few shared stores as the bf16 kernel's (its query and output;
            # converting in a blocked layout and re-laying out through shared memory, as a
            # select on the tile makes the compiler do, stores 22), and one more: the V
            # scales, a vector, re-laid out for P's layout
            bf16 = next(x for x in results if x["kernel"] == r["kernel"]
                        and x["case"] == "bf16")
            assert r["stores"] <= bf16["stores"] + 1, (r, bf16)
    # what a launch needs of an SM (ptxas, through the cuobjdump Triton ships): no kernel
    # asks for more shared memory than an H100/H200 block may have (227 KiB), and none of
    # the bf16 cache's kernels, the decode kernels and the store kernels spills registers
    # to local memory. The fp8 prefill tiles sit at ptxas' 255-register cap (the engine's:
    # no spill with the device's Triton 3.6, 32 bytes with 3.9), so they are left to
    # benchmarks/attention.py --prefill
    for r in results:
        assert r["shared"] <= 227 * 1024, r
        if r.get("spill_bytes") is None:
            continue  # no cuobjdump here
        if r["case"] == "bf16" or r["kernel"] != "_prefill_kernel":
            assert r["spill_bytes"] == 0, f"{r['kernel']} ({r['case']}) spills registers: {r}"
    # the split-K projections (one launch per tile of its table) and the small GEMMs
    # (triton.linear.small_linear, each of its tiles) run on the tensor cores
    assert ("_split_k_kernel", "small-gemm") in compiled
    for r in results:
        if r["case"] in ("split-k", "small-gemm"):
            assert r["ops"]["wgmma"] + r["ops"]["mma.sync"] > 0, r
    sampler = {r["kernel"]: r for r in results if r["case"] == "sampler"}
    # the inverse CDF reads the logits with no noise at all: no Philox, no logarithm
    sums = sampler["_tile_sums_kernel"]
    assert sums["ops"]["mul.hi.u32"] == 0 and sums["ops"]["lg2.approx.f32"] == 0, sums


PDL_KERNELS = ("_store_kv_kernel", "_rope_store_kernel", "_decode_kernel", "_reduce_kernel",
               "_rank_kernel", "_split_k_kernel")


def test_kernels_compile_as_programmatic_dependent_launches():
    """Where the GPU and Triton have them (kernels/triton/launch.py) each step kernel is
    launched with launch_pdl and waits for the kernel before it (griddepcontrol.wait)
    before touching memory: each compiles for sm_90 so, the waits in place."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "tests.model.sm90_ptx", "--pdl"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    if results and "unsupported" in results[-1]:
        pytest.skip(results[-1]["unsupported"])
    waits = {r["kernel"]: r["ops"]["griddepcontrol.wait"] for r in results
             if r["kernel"] in PDL_KERNELS and "error" not in r}
    assert set(waits) == set(PDL_KERNELS), [r for r in results if "error" in r]
    assert all(n >= 1 for n in waits.values()), waits
    # nothing is read before the wait (the kernel before may be writing it)
    for r in results:
        if r["kernel"] in PDL_KERNELS and "error" not in r:
            assert r["loads_before_wait"] == 0, (r["kernel"], r["case"], r["loads"])


def test_pdl_is_never_taken_off_a_gpu():
    import torch

    from nanovllm.kernels.triton import launch as triton_pdl

    assert triton_pdl.pdl_launch(torch.zeros(1)) == {"PDL": False}


def test_pdl_needs_a_triton_that_launches_dependent_kernels(monkeypatch):
    """A Triton without `launch_pdl` and `gdc_wait` (torch 2.5's 3.1) launches the kernels
    as before instead of failing at the first launch on an sm_90 GPU."""
    import triton.language as tl

    from nanovllm.kernels.triton import launch as triton_pdl

    triton_pdl.triton_has_pdl.cache_clear()
    assert triton_pdl.triton_has_pdl() == hasattr(tl.extra.cuda, "gdc_wait")
    monkeypatch.delattr(tl.extra.cuda, "gdc_wait")
    triton_pdl.triton_has_pdl.cache_clear()
    try:
        assert not triton_pdl.triton_has_pdl()
    finally:
        monkeypatch.undo()
        triton_pdl.triton_has_pdl.cache_clear()
