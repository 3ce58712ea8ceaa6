"""`paged_attention(fresh=(k, v))` (Kernels.fresh_prefill, an fp8 cache's engine's): rows of
more than one query token read their own positions from this step's K/V as computed and only
the earlier positions (a cached prefix, earlier chunks) from the cache; decode rows read the
cache only. The expectation is built without that path: the fp64 reference over a copy of
the cache whose own positions hold the fresh values. The fresh values differ from the
cache's there, so a kernel reading the wrong source for any position fails. Triton (CPU
interpreter and, marked gpu, CUDA) and the torch backend, over float32, bf16 and fp8 caches
(row-major, and the GPU's layout: V transposed, K's scales in a plane)."""

import pytest
import torch

from nanovllm.kernels import torch_attention as ta
from tests.model.test_triton_attention import SMALL, Case, check_close, reference
from tests.model.test_triton_fp8 import finite_unread, scale_plane, to_fp8, transposed
from tests.support import triton_module

tb = triton_module("nanovllm.kernels.triton.attention")

# (id, rows (query_len, context_len), Hq, Hkv, head_dim, block_size, prefill cfg)
CASES = [
    ("prefill", [(37, 37), (5, 5), (20, 20)], 2, 2, 64, 16, SMALL),
    ("prefix-hit", [(13, 50), (30, 47), (7, 7)], 4, 2, 64, 32, tb.TileConfig(32, 16)),
    ("mixed", [(1, 90), (24, 60), (1, 5), (9, 9), (1, 40)], 4, 2, 64, 16, tb.TileConfig(16, 32)),
    ("d96", [(10, 30), (1, 45), (20, 20)], 4, 2, 96, 16, SMALL),
    ("default-tiles", [(40, 100), (1, 60), (70, 70)], 4, 1, 64, 16, None),
    # every prefix length mod the KV tile: the cached tiles' masked end and the own
    # positions' diagonal are exact
    ("prefix-sweep", [(5, 5 + p) for p in range(17)], 2, 2, 64, 16, SMALL),
]


def own_positions(c: Case):
    """(cache slot, token index) of each position a multi-token row attends with its own K/V."""
    bs = c.k_cache.shape[1]
    tables = c.meta.block_tables.cpu()
    slots, tokens, start = [], [], 0
    for row, (n, ctx) in enumerate(c.rows):
        if n > 1:
            for pos in range(ctx - n, ctx):
                slots.append(int(tables[row, pos // bs]) * bs + pos % bs)
                tokens.append(start + pos - (ctx - n))
        start += n
    return torch.tensor(slots, dtype=torch.long), torch.tensor(tokens, dtype=torch.long)


def with_own(cache: torch.Tensor, fresh: torch.Tensor, c: Case) -> torch.Tensor:
    """A float copy of `cache` ([blocks, bs, Hkv, D]) whose own positions hold `fresh`'s."""
    slots, tokens = own_positions(c)
    out = cache.clone()
    flat = out.view(-1, *out.shape[2:])
    flat[slots.to(out.device)] = fresh[tokens.to(fresh.device)].to(out.dtype)
    return out


def fresh_kv(c: Case, dtype: torch.dtype):
    """This step's K and V: values unlike the cache's (3x its spread, shifted), q's dtype."""
    gen = torch.Generator().manual_seed(11)
    shape = (c.q.shape[0], c.k_cache.shape[2], c.q.shape[2])
    kn, vn = (3 * torch.randn(shape, generator=gen) + 0.5 for _ in range(2))
    return kn.to(c.device, dtype), vn.to(c.device, dtype)


def caches(c: Case, layout: str):
    """The case's caches in `layout` and the float values a reader of them sees."""
    d = c.q.shape[-1]
    if layout == "float":
        return c.k_cache, c.v_cache, c.k_cache, c.v_cache
    k8, v8 = to_fp8(c.k_cache), to_fp8(c.v_cache)
    # finite past the rows' ends: the GPU layout's tiles and the torch backend's batched
    # decode read whole blocks there, weighing those positions nothing
    k8, v8 = finite_unread(k8, d), finite_unread(v8, d)
    kd, vd = (ta.dequantize_fp8(x, d, torch.float32) for x in (k8, v8))
    if layout == "fp8-gpu":
        k8, v8 = scale_plane(k8, d), transposed(v8)
    return k8, v8, kd, vd


@pytest.mark.parametrize("layout", ["float", "fp8-rows", "fp8-gpu"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_prefill_rows_read_their_own_positions_fresh(triton_device, case, layout):
    name, rows, hq, hkv, d, bs, cfg = case
    c = Case(rows, hq, hkv, d, bs, triton_device, seed=5)
    kc, vc, kd, vd = caches(c, layout)
    kn, vn = fresh_kv(c, c.q.dtype)
    want = reference(c.q, with_own(kd, kn, c), with_own(vd, vn, c), c.meta, c.scale)
    got = tb.paged_attention(c.q, kc, vc, c.meta, c.scale, prefill_config=cfg, fresh=(kn, vn))
    check_close(got, want, torch.float32, f"{name} {layout} triton")
    if layout != "fp8-gpu" or triton_device == "cpu":  # the torch backend: once is enough
        clean = [torch.nan_to_num(t.double(), nan=0.0) if t.is_floating_point() else t
                 for t in (c.q, kc, vc)]
        torch_got = ta.paged_attention(*clean, c.meta, c.scale,
                                       fresh=(kn.double(), vn.double()))
        check_close(torch_got, want, torch.float32, f"{name} {layout} torch")
    # without `fresh` the kernel reads the cache's values: a different answer here
    assert not torch.allclose(tb.paged_attention(c.q, kc, vc, c.meta, c.scale,
                                                 prefill_config=cfg).cpu().double(), want,
                              atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["float", "fp8-gpu"])
def test_fresh_half_precision_queries(triton_device, layout, dtype):
    """A half-precision model's step (on a GPU the fp8 cache's tiles go through float16
    there, the fresh ones stay in q's dtype): within its error of the same expectation."""
    if dtype == torch.bfloat16 and triton_device == "cpu":
        pytest.skip("Triton's CPU interpreter multiplies bf16 dot operands as raw bits")
    c = Case([(1, 70), (33, 80), (40, 40)], 4, 2, 64, 16, triton_device, seed=3)
    kc, vc, kd, vd = caches(c, layout)
    if layout == "float":
        kc, vc = kc.to(dtype), vc.to(dtype)
    kn, vn = fresh_kv(c, dtype)
    q = c.q.to(dtype)
    want = reference(q, with_own(kd, kn, c), with_own(vd, vn, c), c.meta, c.scale)
    got = tb.paged_attention(q, kc, vc, c.meta, c.scale, prefill_config=SMALL, fresh=(kn, vn))
    check_close(got, want, dtype, f"{layout} {dtype}")


def test_fresh_of_another_shape_is_refused(triton_device):
    c = Case([(9, 20), (1, 30)], 2, 2, 64, 128, triton_device, seed=1)
    kn, vn = fresh_kv(c, c.q.dtype)
    with pytest.raises(ValueError, match="fresh K/V must be"):
        tb.paged_attention(c.q, c.k_cache, c.v_cache, c.meta, c.scale, fresh=(kn[:, :1], vn))
