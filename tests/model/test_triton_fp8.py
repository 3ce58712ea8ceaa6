"""The Triton kernels on an fp8 KV cache (kv_cache_dtype="fp8") against the torch reference:
`store_kv` writes the bytes the reference writes (float8 e4m3 values, then each token-head's
float32 scale), and `paged_attention` over those bytes equals the reference's attention over
the same values dequantized (prefill, prefix hits, decode with and without KV splits, mixed
batches, a head_dim that is not a power of 2). Unread slots hold NaN bytes and NaN scales.
In Triton's CPU interpreter, and marked gpu, compiled on CUDA (`triton_device`)."""

import pytest
import torch

from nanovllm.kernels import torch_attention as ta
from tests.model.test_triton_attention import SMALL, Case, check_close, reference
from tests.support import triton_module

tb = triton_module("nanovllm.kernels.triton_attention")
NAN_BYTE = 0x7F  # e4m3fn NaN

CASES = [
    ("prefill", [(37, 37), (5, 5), (20, 20)], 2, 2, 64, 16, SMALL, None),
    ("prefix-hit", [(13, 50), (30, 47), (7, 7)], 4, 2, 64, 32, tb.TileConfig(32, 16), None),
    ("decode", [(1, 40), (1, 70), (1, 3), (1, 16)], 8, 2, 64, 16, None, None),
    ("decode-splits", [(1, 300), (1, 700), (1, 1), (1, 257)], 8, 1, 64, 16, None, None),
    ("mixed", [(1, 90), (24, 60), (1, 5), (9, 9)], 4, 2, 64, 16, tb.TileConfig(16, 32), None),
    ("d96", [(10, 30), (1, 45), (20, 20)], 4, 2, 96, 16, SMALL, None),
]


def to_fp8(cache: torch.Tensor, width: int) -> torch.Tensor:
    """A float cache's values as fp8 bytes; NaN slots (unread) become NaN bytes and scales."""
    blocks, bs, heads, dim = cache.shape
    flat = cache.reshape(-1, heads, dim)
    nan = torch.isnan(flat).any(-1)
    raw = ta.quantize_fp8(torch.nan_to_num(flat.float(), nan=0.0), width)
    raw[..., :dim][nan] = NAN_BYTE
    if width > dim:
        raw[..., dim:dim + 4][nan] = torch.tensor([float("nan")]).view(torch.uint8).to(raw.device)
    return raw.view(blocks, bs, heads, width)


@pytest.mark.parametrize("scaled", [True, False], ids=["token", "tensor"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_attention_over_fp8_matches_the_reference(triton_device, case, scaled):
    _, rows, hq, hkv, d, bs, cfg, splits = case
    c = Case(rows, hq, hkv, d, bs, triton_device, seed=7)
    width = ta.fp8_width(d, scaled)
    k8, v8 = to_fp8(c.k_cache, width), to_fp8(c.v_cache, width)
    out = tb.paged_attention(c.q, k8, v8, c.meta, c.scale, prefill_config=cfg,
                             num_splits=splits)
    # the reference reads the same values, dequantized (NaN where unread)
    kd, vd = (ta.dequantize_fp8(x, d, torch.float32) for x in (k8, v8))
    check_close(out, reference(c.q, kd, vd, c.meta, c.scale), torch.float32, case[0])


@pytest.mark.parametrize("scaled", [True, False], ids=["token", "tensor"])
def test_store_kv_writes_the_reference_bytes(triton_device, scaled):
    torch.manual_seed(3)
    tokens, heads, dim, bs, blocks = 40, 2, 64, 16, 8
    width = ta.fp8_width(dim, scaled)
    k = (torch.randn(tokens, heads, dim) * torch.logspace(-2, 2, tokens)[:, None, None])
    v = torch.randn(tokens, heads, dim)
    slots = torch.randperm(blocks * bs)[:tokens]
    slots[::7] = -1  # skipped tokens
    got_k = torch.zeros(blocks, bs, heads, width, dtype=torch.uint8, device=triton_device)
    got_v = torch.zeros_like(got_k)
    tb.store_kv(k.to(triton_device), v.to(triton_device), got_k, got_v,
                slots.to(triton_device))
    want_k = torch.zeros(blocks, bs, heads, width, dtype=torch.uint8)
    want_v = torch.zeros_like(want_k)
    ta.store_kv(k, v, want_k, want_v, slots)
    for got, want in ((got_k.cpu(), want_k), (got_v.cpu(), want_v)):
        if triton_device == "cpu":
            assert torch.equal(got, want)
        else:  # a GPU's division may round the last bit of a few quotients differently
            a, b = (ta.dequantize_fp8(x, dim, torch.float32) for x in (got, want))
            torch.testing.assert_close(a, b, rtol=0.13, atol=1e-6)
