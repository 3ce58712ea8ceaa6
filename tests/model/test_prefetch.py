"""Weights asked of the L2 ahead of their projection (kernels/triton_pdl.py
PREFETCH_WEIGHTS): the RMSNorms before qkv and gate_up are told the projection's weight,
and the split-K projections ask for their own rows, before their PDL wait; and the fp8
decode's first tiles (triton_decode.PREFETCH_FIRST_TILE). Hints: every result is the same
bits with them as without, and they are never taken off a GPU. That the
prefetch compiles before the wait is test_triton_ptx.py's; what it gains is BENCHMARKS.md's.
"""

import pytest
import torch

from nanovllm import LLM
from nanovllm.kernels import torch_ops as ref
from tests.support import greedy, make_prompts, triton_module

pdl = triton_module("nanovllm.kernels.triton_pdl")
ops = triton_module("nanovllm.kernels.triton_ops")
linear = triton_module("nanovllm.kernels.triton_linear")
decode = triton_module("nanovllm.kernels.triton_decode")


def randn(*shape, device, dtype, seed) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device, dtype)


def test_prefetch_is_never_taken_off_a_gpu(monkeypatch):
    monkeypatch.setattr(pdl, "PREFETCH_WEIGHTS", True)
    assert not pdl.prefetch_launch(torch.zeros(4))
    monkeypatch.setattr(pdl, "PREFETCH_WEIGHTS", False)
    assert not pdl.prefetch_launch(torch.zeros(4))


@pytest.mark.parametrize("rows", [1, 7, 256])
def test_norms_told_a_weight_give_the_same_bits(triton_device, rows, monkeypatch):
    dtype = torch.bfloat16 if triton_device == "cuda" else torch.float32
    x = randn(rows, 1024, device=triton_device, dtype=dtype, seed=1)
    residual = randn(rows, 1024, device=triton_device, dtype=dtype, seed=2)
    w = (1 + 0.1 * randn(1024, device=triton_device, dtype=torch.float32, seed=3)).to(dtype)
    # a weight of odd size (not a multiple of the programs' shares) and the engine's qkv's
    weights = [randn(4096, 1024, device=triton_device, dtype=dtype, seed=4),
               randn(3, 40, device=triton_device, dtype=dtype, seed=5)]
    plain = ops.rms_norm(x, w, 1e-6)
    plain_add = ops.add_rms_norm(x, residual.clone(), w, 1e-6)
    monkeypatch.setattr(pdl, "PREFETCH_WEIGHTS", True)
    assert pdl.prefetch_launch(x) == (triton_device == "cuda" and pdl.pdl_launch(x)["PDL"])
    for weight in weights:
        assert torch.equal(ops.rms_norm(x, w, 1e-6, prefetch=weight), plain)
        out, res = ops.add_rms_norm(x, residual.clone(), w, 1e-6, prefetch=weight)
        assert torch.equal(out, plain_add[0]) and torch.equal(res, plain_add[1])
    expected = ref.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(plain.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64, 256])
@pytest.mark.parametrize("k", [2048, 3072])
def test_gpu_split_k_with_prefetch_gives_the_same_bits(rows, k, monkeypatch):
    x = randn(rows, k, device="cuda", dtype=torch.bfloat16, seed=1)
    w = randn(1024, k, device="cuda", dtype=torch.bfloat16, seed=2) * k ** -0.5
    plain = linear.split_k_linear(x, w)
    monkeypatch.setattr(pdl, "PREFETCH_WEIGHTS", True)
    assert pdl.prefetch_launch(x) == pdl.pdl_launch(x)["PDL"]
    told = linear.split_k_linear(x, w)
    assert plain is not None and torch.equal(told.parts, plain.parts)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_gpu_engine_with_prefetch_gives_the_same_tokens(tiny_model, kv_cache_dtype,
                                                        monkeypatch):
    # and the fp8 decode asking for its first tile (triton_decode.PREFETCH_FIRST_TILE),
    # which an fp8 cache in the GPU's layout takes
    prompts = make_prompts(seed=7, count=8, shared_prefix=8)
    outs = []
    for on in (False, True):
        monkeypatch.setattr(pdl, "PREFETCH_WEIGHTS", on)
        monkeypatch.setattr(decode, "PREFETCH_FIRST_TILE", on)
        llm = LLM(str(tiny_model), device="cuda", dtype="bfloat16", max_model_len=512,
                  kv_cache_gib=1, kv_cache_dtype=kv_cache_dtype)
        long = [p * 4 for p in prompts[:2]]  # contexts of several blocks, and KV splits
        outs.append([o.token_ids for o in llm.generate(prompts + long, greedy(12),
                                                       use_tqdm=False)])
        del llm
    assert outs[0] == outs[1]
