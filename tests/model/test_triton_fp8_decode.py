"""The fp8 decode on the fp8 tensor cores (kernels/triton_fp8_decode.py, the engine's
`fp8_attention`) against its numerics stated in torch (`torch_attention.fp8_decode_reference`:
q in e4m3, P in e4m3 or float16), and both against the attention over the cache's values,
within what fp8 costs. Decode rows across tile edges, an empty padding row and a prefill row
it must leave alone, with and without KV splits, both fp8 formats. In Triton's CPU
interpreter and, marked gpu, compiled on CUDA (`triton_device`)."""

import pytest
import torch

from nanovllm.kernels import torch_attention as ta
from tests.model.test_triton_attention import Case, reference
from tests.model.test_triton_fp8 import to_fp8, transposed
from tests.support import triton_module

fd = triton_module("nanovllm.kernels.triton_fp8_decode")
tb = triton_module("nanovllm.kernels.triton_attention")

# (query_len, context_len): tile edges at 128, a one-token context, a padding row (context
# 0), a prefill row the kernel skips
ROWS = [(1, 300), (1, 128), (1, 1), (1, 129), (3, 40), (1, 0)]


def fp8_batch(device: str, scaled: bool, block_size: int = 128):
    c = Case(ROWS, 4, 2, 32, block_size, device, seed=11)
    width = ta.fp8_width(32, scaled)
    # the unread slots: finite bytes, as the engine's store leaves them (the kernel reads a
    # tile's positions past the context and weighs them 0)
    k8, v8 = (to_fp8(torch.nan_to_num(x, nan=3.0), width) for x in (c.k_cache, c.v_cache))
    return c, k8, transposed(v8)


@pytest.mark.parametrize("fp8_p", [True, False], ids=["p-fp8", "p-fp16"])
@pytest.mark.parametrize("scaled", [True, False], ids=["token", "tensor"])
def test_decode_fp8_matches_its_numerics_and_the_attention(triton_device, scaled, fp8_p):
    c, k8, v8 = fp8_batch(triton_device, scaled)
    out = torch.full_like(c.q, float("nan"))
    got = fd.decode_fp8(c.q, k8, v8, c.meta, c.scale, fp8_p=fp8_p, num_splits=1, out=out)
    assert got is out
    got = got.cpu()
    want = ta.fp8_decode_reference(c.q.cpu(), k8.cpu(), v8.cpu(), c.meta, c.scale, fp8_p=fp8_p)
    decode = torch.tensor([q == 1 and n > 0 for q, n in ROWS])
    rows = torch.repeat_interleave(decode, torch.tensor([q for q, _ in ROWS]))
    # the same numerics: float32 sums in another order, and a rounding of P to e4m3 may
    # fall the other way now and then (more often on a GPU, whose exp2 is approximate): a
    # weight moves by 1/8 of itself, so a few heads' outputs move by up to a few percent
    # (H200: 3 heads of 16 at 4e-3 to 1.3e-2, the others ~1e-4; P in float16 instead of
    # e4m3 would put the median at ~2e-2)
    if fp8_p:
        err = (got[rows] - want[rows]).norm(dim=-1) / want[rows].norm(dim=-1)  # per head
        assert err.median() < 1e-3 and err.max() < 0.05, (err.median(), err.max())
    else:
        torch.testing.assert_close(got[rows], want[rows], rtol=2e-3, atol=2e-3)
    # rows other than decode rows are not the kernel's; a padding row (context 0) gets 0
    padding = torch.repeat_interleave(torch.tensor([q == 1 and n == 0 for q, n in ROWS]),
                                      torch.tensor([q for q, _ in ROWS]))
    assert got[~rows & ~padding].isnan().all() and not got[padding].any()
    # and the attention over the cache's values (dequantized), within fp8's error: q and P
    # rounded to 3 mantissa bits
    d = c.q.shape[-1]
    kd, vd = (ta.dequantize_fp8(x, d, torch.float32) for x in (k8, v8))
    exact = reference(c.q, kd, vd, c.meta, c.scale)
    err = (got[rows] - exact[rows]).flatten(1).norm(dim=1) / exact[rows].flatten(1).norm(dim=1)
    assert err.max() < (0.06 if fp8_p else 0.03), err


def test_decode_fp8_longest_rows_first_is_the_same_attention(triton_device):
    c, k8, v8 = fp8_batch(triton_device, True)
    order = torch.argsort(c.meta.context_lens, descending=True).to(torch.int32)
    for splits in (1, 2):
        plain = fd.decode_fp8(c.q, k8, v8, c.meta, c.scale, num_splits=splits)
        longest = fd.decode_fp8(c.q, k8, v8, c.meta, c.scale, num_splits=splits, order=order)
        assert torch.equal(plain, longest)


@pytest.mark.parametrize("fp8_p", [True, False], ids=["p-fp8", "p-fp16"])
def test_decode_fp8_splits_combine_to_one_split(triton_device, fp8_p):
    # the 300-token row in three splits of one tile each: the same attention, except that
    # each split rounds its P to e4m3 against its own running maximum (fp8_p)
    c, k8, v8 = fp8_batch(triton_device, True, block_size=256)
    one, three = (fd.decode_fp8(c.q, k8, v8, c.meta, c.scale, fp8_p=fp8_p, num_splits=n).cpu()
                  for n in (1, 3))
    err = (three - one).flatten(1).norm(dim=1) / one.flatten(1).norm(dim=1).clamp_min(1e-6)
    assert err.max() < (0.03 if fp8_p else 1e-3), err


def test_fp8_decode_reference_of_every_query_token():
    # what benchmarks/kv_accuracy.py applies to every attention: the prefill row's tokens,
    # each over its causal context, within fp8's error of the exact attention
    c, k8, v8 = fp8_batch("cpu", True)
    got = ta.fp8_decode_reference(c.q, k8, v8, c.meta, c.scale, decode_only=False)
    kd, vd = (ta.dequantize_fp8(x, 32, torch.float32) for x in (k8, v8))
    exact = reference(c.q, kd, vd, c.meta, c.scale)
    real = exact.flatten(1).norm(dim=1) > 0  # all but the padding row
    err = (got - exact)[real].flatten(1).norm(dim=1) / exact[real].flatten(1).norm(dim=1)
    assert real.sum() == 7 and err.max() < 0.06, err
    decode_only = ta.fp8_decode_reference(c.q, k8, v8, c.meta, c.scale)
    assert torch.equal(decode_only[:4], got[:4]) and not decode_only[4:7].any()


@pytest.mark.parametrize("mode", ["q", "qp"])
def test_prefill_on_the_fp8_tensor_cores(triton_device, mode):
    # paged_attention(fp8_attention=...): prefill rows (fresh and over a cached prefix, across
    # tile edges) by the prefill kernel's fp8 path, decode rows by decode_fp8, in one batch;
    # every row as fp8_decode_reference computes it
    rows = [(200, 200), (1, 300), (37, 170), (3, 3), (1, 129), (130, 260)]
    c = Case(rows, 4, 2, 32, 128, triton_device, seed=13)
    width = ta.fp8_width(32, True)
    k8, v8 = (to_fp8(torch.nan_to_num(x, nan=3.0), width) for x in (c.k_cache, c.v_cache))
    v8 = transposed(v8)
    # (one split: each split rounds P against its own maximum)
    got = tb.paged_attention(c.q, k8, v8, c.meta, c.scale, fp8_attention=mode,
                             num_splits=1).cpu()
    want = ta.fp8_decode_reference(c.q.cpu(), k8.cpu(), v8.cpu(), c.meta, c.scale,
                                   fp8_p=mode == "qp", decode_only=False)
    err = (got - want).flatten(1).norm(dim=1) / want.flatten(1).norm(dim=1)
    # float32 sums in another order; now and then a weight of P lands on the other side of
    # a rounding to e4m3 (whose steps are 1/8 of the value): a token moves by ~1%
    assert (err > 1e-4).float().mean() < 0.05 and err.max() < 0.03, err.max()
    plain = tb.paged_attention(c.q, k8, v8, c.meta, c.scale).cpu()
    assert (got - plain).abs().max() > 1e-3  # the numerics are not the converting kernels'


def test_decode_fp8_refuses_other_caches(triton_device):
    c, k8, v8 = fp8_batch(triton_device, True)
    with pytest.raises(ValueError, match="V transposed"):
        fd.decode_fp8(c.q, k8, v8.contiguous(), c.meta, c.scale)
    c16 = Case(ROWS, 4, 2, 32, 16, triton_device)
    with pytest.raises(ValueError, match="fp8 cache"):
        fd.decode_fp8(c16.q, c16.k_cache, c16.v_cache, c16.meta, c16.scale)


def test_decode_fp8_over_a_k_scale_plane(triton_device):
    """K's scales in a plane after each block-head's values (kv_cache.FP8_K_SCALE_PLANE):
    the same output as over K's padded rows."""
    from tests.model.test_triton_fp8 import scale_plane

    c, k8, v8 = fp8_batch(triton_device, True)
    rows = fd.decode_fp8(c.q, k8, v8, c.meta, c.scale, num_splits=2)
    plane = fd.decode_fp8(c.q, scale_plane(k8, c.q.shape[-1]), v8, c.meta, c.scale,
                          num_splits=2)
    torch.testing.assert_close(plane, rows, rtol=0, atol=0)

