"""`paged_attention(new_kv=(k, v))` (kernels.DECODE_STORES): in a step of decode rows, the
decode programs read each row's positions before its new one from the cache; the program
whose split holds the new one adds it from the step's K/V, rounded as the store rounds it,
then stores it into its slot. Against `store_kv` then `paged_attention` over a second copy
of the same cache: every byte of both caches the same, and the same output within float32
rounding (the new position is summed apart from its tile's dot); padding rows (no
context, slot -1) store nothing. Triton (CPU interpreter and, marked gpu, CUDA) over
float32 and fp8 caches (row-major, and the GPU's layout: V transposed, K's scales in a
plane), with one split and with several (a row's last tile then lies in an early split for
short rows)."""

import pytest
import torch

from tests.model.test_fresh_prefill import caches, fresh_kv
from tests.model.test_triton_attention import Case
from tests.support import triton_module

tb = triton_module("nanovllm.kernels.triton_attention")

# (id, context lengths (0: a padding row), Hq, Hkv, head_dim, block_size, num_splits)
CASES = [
    ("one-split", [33, 1, 70, 16, 17], 4, 2, 64, 16, 1),
    ("splits", [200, 5, 129, 64, 0], 4, 2, 64, 16, 3),
    ("d96", [40, 9, 0, 31], 4, 2, 96, 32, 2),
]


def decode_case(contexts, hq, hkv, d, bs, device) -> Case:
    """A step of decode rows over `contexts`, each row's new position (its last) mapped to
    its slot; a row of context 0 is a CUDA graph's padding: slot -1."""
    c = Case([(1, n) for n in contexts], hq, hkv, d, bs, device, seed=7)
    tables = c.meta.block_tables.cpu()
    slots = [int(tables[r, (n - 1) // bs]) * bs + (n - 1) % bs if n else -1
             for r, n in enumerate(contexts)]
    c.meta.slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    return c


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """Every byte of the tensor's storage (a cache's views have gaps and odd strides)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


@pytest.mark.parametrize("layout", ["float", "fp8-rows", "fp8-gpu"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_decode_program_stores_then_reads_the_new_kv(triton_device, case, layout):
    name, contexts, hq, hkv, d, bs, splits = case
    # two copies of the same cache (same seed): one stored by store_kv, one by the kernel
    runs = []
    for by_kernel in (False, True):
        c = decode_case(contexts, hq, hkv, d, bs, triton_device)
        kc, vc, _, _ = caches(c, layout)
        before = storage_bytes(kc).clone(), storage_bytes(vc).clone()
        kn, vn = fresh_kv(c, c.q.dtype)
        kw = dict(num_splits=splits)
        if by_kernel:
            out = tb.paged_attention(c.q, kc, vc, c.meta, c.scale, new_kv=(kn, vn), **kw)
        else:
            tb.store_kv(kn, vn, kc, vc, c.meta.slot_mapping)
            out = tb.paged_attention(c.q, kc, vc, c.meta, c.scale, **kw)
        runs.append((out, storage_bytes(kc), storage_bytes(vc), before))
    (want, want_k, want_v, before), (got, got_k, got_v, _) = runs
    # the new K/V differ from the values in their slots: the store moved bytes
    assert not torch.equal(want_k, before[0]) and not torch.equal(want_v, before[1])
    assert torch.equal(got_k, want_k), f"{name} {layout}: K cache bytes"
    assert torch.equal(got_v, want_v), f"{name} {layout}: V cache bytes"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"{name} {layout}: output")


def test_new_kv_is_for_decode_steps_only(triton_device):
    c = Case([(5, 20), (1, 30)], 2, 2, 64, 16, triton_device, seed=1)
    kn, vn = fresh_kv(c, c.q.dtype)
    with pytest.raises(ValueError, match="decode rows only"):
        tb.paged_attention(c.q, c.k_cache, c.v_cache, c.meta, c.scale, new_kv=(kn, vn))
