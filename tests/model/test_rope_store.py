"""The fused RoPE + K/V store kernel (triton.kv_store.qk_norm_rope_store) against the two
launches it replaces, `qk_norm_rope` then `store_kv`: the same q, the same k, the same cache
bytes, for a cache in the model's dtype and an fp8 one in both layouts (row-major, and the
GPU's: V transposed, K's scales in a plane), with skipped (-1) slots; and a model whose
layers take the fused path against one whose layers do not. In Triton's CPU interpreter
and, marked gpu, compiled on CUDA."""

import dataclasses

import pytest
import torch

from nanovllm.kernels import select_kernels
from nanovllm.kernels import torch_attention as ta
from tests.model.test_fused_ops import norm_weight, prefill_logits, randn, rope_tables, tiny_qwen3
from tests.model.test_triton_fp8 import scale_plane, transposed
from tests.support import triton_module

ts = triton_module("nanovllm.kernels.triton.kv_store")
ops = triton_module("nanovllm.kernels.triton.ops")

FORMATS = ["model-dtype", "fp8-rows", "fp8-gpu"]


def caches(fmt: str, blocks: int, bs: int, hkv: int, d: int, dtype, device):
    if fmt == "model-dtype":
        k = torch.full((blocks, bs, hkv, d), float("nan"), dtype=dtype, device=device)
        return k, k.clone()
    k = torch.zeros(blocks, bs, hkv, ta.fp8_width(d), dtype=torch.uint8, device=device)
    if fmt == "fp8-gpu":
        return scale_plane(k, d), transposed(k.clone())
    return k, k.clone()


def logical_bytes(cache: torch.Tensor) -> torch.Tensor:
    """Every block of a cache in the row-major layout, as bytes (a scale plane's through its
    two parts)."""
    every = torch.arange(cache.shape[0], device=cache.device)
    return ta._blocks(cache, every).cpu().view(torch.uint8)


@pytest.mark.parametrize("with_norm", [True, False], ids=["qk-norm", "no-norm"])
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 32), (6, 3, 48)], ids=["pow2", "odd-widths"])
@pytest.mark.parametrize("fmt,pattern,apart", [
    *((f, "scattered", True) for f in FORMATS), ("model-dtype", "chunk", True),
    # a transposed V's store both ways, also over complete runs
    ("fp8-gpu", "scattered", False), *(("fp8-gpu", "chunk", a) for a in (True, False))])
def test_fused_equals_rope_then_store(triton_device, fmt, with_norm, hq, hkv, d, apart,
                                      pattern, monkeypatch):
    """`apart`: where the V is stored transposed, each token's V stored by a program of its
    own (a launch of up to V_APART_MAX_TOKENS tokens), or after its K (a larger launch's
    way, taken here by lowering the limit); `pattern`: slots scattered (a decode step's),
    or a prefill chunk's consecutive slots from mid-block, whose complete runs of 16 an fp8
    V stored transposed takes a run at a time (triton/kv_store.py)."""
    if not apart:
        monkeypatch.setattr(ts, "V_APART_MAX_TOKENS", 0)
    bs, blocks = 16, 4
    if pattern == "scattered":
        tokens = 11
        slots = torch.randperm(blocks * bs, generator=torch.Generator().manual_seed(3))[:tokens]
        slots[::4] = -1  # tokens that write nothing (padding rows, prefix hits)
    else:
        tokens = 40
        slots = torch.arange(5, 5 + tokens)
        slots[30] = -1
    dtype = torch.float16
    q_size, kv_size = hq * d, hkv * d
    # q, k and v as the model has them: views into one qkv projection output
    qkv = randn(tokens, q_size + 2 * kv_size, dtype=dtype, device=triton_device, seed=5)
    cos, sin = rope_tables(d, 64, triton_device)
    positions = torch.randint(0, 64, (tokens,), generator=torch.Generator().manual_seed(2))
    positions = positions.to(triton_device)
    slots = slots.to(triton_device)
    norms = ((norm_weight(d, triton_device, dtype), norm_weight(d, triton_device, dtype, 4),
              1e-6) if with_norm else ())

    def split(t):
        q, k, v = t.split([q_size, kv_size, kv_size], dim=-1)
        return q.view(-1, hq, d), k.view(-1, hkv, d), v.view(-1, hkv, d)

    want_qkv, got_qkv = qkv.clone(), qkv.clone()
    want_k, want_v = caches(fmt, blocks, bs, hkv, d, dtype, triton_device)
    got_k, got_v = caches(fmt, blocks, bs, hkv, d, dtype, triton_device)
    q, k, v = split(want_qkv)
    ops.qk_norm_rope(q, k, positions, cos, sin, *norms)
    ts.store_kv(k, v, want_k, want_v, slots)
    q, k, v = split(got_qkv)
    out_q, out_k = ts.qk_norm_rope_store(q, k, v, positions, cos, sin, got_k, got_v, slots,
                                         *norms)
    assert out_q is q and out_k is k  # in place, as qk_norm_rope
    assert torch.equal(got_qkv, want_qkv)
    for got, want in ((got_k, want_k), (got_v, want_v)):
        assert torch.equal(logical_bytes(got), logical_bytes(want))
    # an unallocated cache (the memory profile's forward): the RoPE alone
    q, k, v = split(qkv.clone())
    ts.qk_norm_rope_store(q, k, v, positions, cos, sin, torch.empty(0), torch.empty(0), slots,
                          *norms)
    assert torch.equal(q, split(want_qkv)[0])


def test_v_apart_up_to_a_decode_steps_tokens():
    """A launch's V is stored apart for up to V_APART_MAX_TOKENS tokens into a transposed V
    cache (where it measured faster), never over a row-major V; a count and the cache's
    layout only, so a captured graph replays one grid."""
    _, v_t = caches("fp8-gpu", 2, 16, 2, 32, torch.float16, "cpu")
    _, v_rows = caches("fp8-rows", 2, 16, 2, 32, torch.float16, "cpu")
    v_t, v_rows = ta.v_transposed(v_t), ta.v_transposed(v_rows)  # the store's V_T flag
    assert ts.v_apart(1, v_t) and ts.v_apart(ts.V_APART_MAX_TOKENS, v_t)
    assert not ts.v_apart(ts.V_APART_MAX_TOKENS + 1, v_t)
    assert not ts.v_apart(1, v_rows)


def test_the_fused_path_is_the_triton_engines():
    assert select_kernels("triton", "triton").qk_norm_rope_store is ts.qk_norm_rope_store
    for choice in (("torch", "torch"), ("triton", "torch"), ("torch", "triton")):
        assert select_kernels(*choice).qk_norm_rope_store is None, choice


@pytest.mark.parametrize("qk_norm", [True, False], ids=["qwen3", "llama"])
def test_a_model_on_the_fused_path(triton_device, qk_norm):
    """Each layer of a Triton-kernel model makes one fused launch and no separate store, and
    its logits are the torch kernels' (prefill of two sequences into a paged cache)."""
    calls = {"qk_norm_rope_store": 0, "store_kv": 0}

    def counted(name, fn):
        def call(*args, **kw):
            calls[name] += 1
            return fn(*args, **kw)

        return call

    def logits(kernels) -> torch.Tensor:
        return prefill_logits(tiny_qwen3(qk_norm, kernels, triton_device), triton_device)

    fused = select_kernels("triton", "triton")
    kernels = dataclasses.replace(
        fused, qk_norm_rope_store=counted("qk_norm_rope_store", fused.qk_norm_rope_store),
        store_kv=counted("store_kv", fused.store_kv))
    got = logits(kernels)
    assert calls == {"qk_norm_rope_store": 2, "store_kv": 0}  # one launch per layer
    want = logits(select_kernels("torch", "torch"))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
