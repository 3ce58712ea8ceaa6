"""The Triton kernels on an fp8 KV cache (kv_cache_dtype="fp8") against the torch reference:
`store_kv` writes the bytes the reference writes (float8 e4m3 values, then each token-head's
float32 scale), and `paged_attention` over those bytes equals the reference's attention over
the same values dequantized (prefill, prefix hits, decode with and without KV splits, mixed
batches, a head_dim that is not a power of 2), over both layouts an engine gives them:
row-major (blocks under 16 tokens), and the GPU's (V transposed within each block, K
head-major with its scales in a plane: worker/kv_cache.py). Unread slots hold NaN bytes and
NaN scales. In Triton's CPU interpreter, and marked gpu, compiled on CUDA (`triton_device`)."""

import pytest
import torch

from nanovllm.kernels import torch_attention as ta
from tests.model.test_triton_attention import SMALL, Case, check_close, reference
from tests.support import triton_module

tb = triton_module("nanovllm.kernels.triton.attention")
NAN_BYTE = 0x7F  # e4m3fn NaN

CASES = [
    ("prefill", [(37, 37), (5, 5), (20, 20)], 2, 2, 64, 16, SMALL, None),
    ("prefix-hit", [(13, 50), (30, 47), (7, 7)], 4, 2, 64, 32, tb.TileConfig(32, 16), None),
    ("decode", [(1, 40), (1, 70), (1, 3), (1, 16)], 8, 2, 64, 16, None, None),
    ("decode-splits", [(1, 300), (1, 700), (1, 1), (1, 257)], 8, 1, 64, 16, None, None),
    ("mixed", [(1, 90), (24, 60), (1, 5), (9, 9)], 4, 2, 64, 16, tb.TileConfig(16, 32), None),
    ("d96", [(10, 30), (1, 45), (20, 20)], 4, 2, 96, 16, SMALL, None),
]


def to_fp8(cache: torch.Tensor) -> torch.Tensor:
    """A float cache's values as fp8 bytes; NaN slots (unread) become NaN bytes and scales."""
    blocks, bs, heads, dim = cache.shape
    width = ta.fp8_width(dim)
    flat = cache.reshape(-1, heads, dim)
    nan = torch.isnan(flat).any(-1)
    raw = ta.quantize_fp8(torch.nan_to_num(flat.float(), nan=0.0), width)
    raw[..., :dim][nan] = NAN_BYTE
    raw[..., dim:dim + 4][nan] = torch.tensor([float("nan")]).view(torch.uint8).to(raw.device)
    return raw.view(blocks, bs, heads, width)


def fp8_case(case, device: str):
    """The case's batch, its caches as fp8 bytes, and its attention over them."""
    _, rows, hq, hkv, d, bs, cfg, splits = case
    c = Case(rows, hq, hkv, d, bs, device, seed=7)
    k8, v8 = to_fp8(c.k_cache), to_fp8(c.v_cache)
    attend = lambda k, v: tb.paged_attention(c.q, k, v, c.meta, c.scale, prefill_config=cfg,
                                             num_splits=splits)
    return c, k8, v8, attend


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_attention_over_fp8_matches_the_reference(triton_device, case):
    c, k8, v8, attend = fp8_case(case, triton_device)
    # the reference reads the same values, dequantized (NaN where unread)
    d = c.q.shape[-1]
    kd, vd = (ta.dequantize_fp8(x, d, torch.float32) for x in (k8, v8))
    check_close(attend(k8, v8), reference(c.q, kd, vd, c.meta, c.scale), torch.float32,
                case[0])


def transposed(cache: torch.Tensor) -> torch.Tensor:
    """The same logical cache stored as an fp8 V cache is (worker/kv_cache.py): each block's
    bytes [Hkv, width, block_size], seen as [blocks, block_size, Hkv, width]."""
    view = cache.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    assert ta.v_transposed(view) and not ta.v_transposed(cache)
    return view


def finite_unread(v8: torch.Tensor, d: int) -> torch.Tensor:
    """A copy of an fp8 V cache whose unread slots hold the largest e4m3 value and a large
    scale instead of NaN: over a transposed V the kernels read a tile's positions past the
    context (in the same block), which must weigh nothing, but may not be NaN (the store
    never writes one)."""
    v8 = v8.clone()
    values, scales = v8[..., :d], v8[..., d:d + 4]
    unread = (values == NAN_BYTE).all(-1)
    values[unread] = 0x7E
    scales[unread] = torch.tensor([1e4]).view(torch.uint8).to(v8.device)
    return v8


def scale_plane(k8: torch.Tensor, d: int) -> torch.Tensor:
    """The same logical K cache stored as an engine stores it beside a transposed V
    (worker/kv_cache.py): each block-head's [block_size, d] value bytes, then its
    [block_size] float32 scales."""
    heads = torch.zeros_like(k8).permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    plane = ta.scale_plane_view(heads, d)
    assert ta.k_scale_plane(plane) and not ta.k_scale_plane(heads)
    values, scales = ta.scale_plane_parts(plane)
    values.copy_(k8[..., :d])
    scales.copy_(k8[..., d:d + 4])
    return plane


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_attention_over_the_gpu_layout(triton_device, case):
    """K's scales in a plane after each block-head's values, beside a V stored transposed
    within each block (positions contiguous, the scale's 4 bytes in 4 rows): the Triton
    kernels (prefill, prefix hits, decode with and without splits, mixed; their tiles shrink
    to the block size, the prefix-hit case's 32-position tiles over blocks of 32, the
    others' over 16) and the torch reference over it both give the attention of the
    row-major caches."""
    c, k8, v8, attend = fp8_case(case, triton_device)
    d = c.q.shape[-1]
    v8 = finite_unread(v8, d)
    k8 = finite_unread(k8, d)
    kp, vt = scale_plane(k8, d), transposed(v8)
    kd, vd = (ta.dequantize_fp8(x, d, torch.float32) for x in (k8, v8))
    want = reference(c.q, kd, vd, c.meta, c.scale)
    check_close(attend(kp, vt), want, torch.float32, case[0])
    torch_got = ta.paged_attention(c.q, kp, vt, c.meta, c.scale)
    torch.testing.assert_close(torch_got, ta.paged_attention(c.q, k8, v8, c.meta, c.scale),
                               rtol=0, atol=0)


DECODE_CASES = [c for c in CASES if c[0].startswith("decode")]


@pytest.mark.parametrize("case", DECODE_CASES, ids=[c[0] for c in DECODE_CASES])
def test_decode_over_the_gpu_layout_with_group_rows(triton_device, case):
    """The decode over the GPU's layout with its dots over the GQA group's heads only
    (TileConfig.block_m=2: Triton pads the dot; over 16 rows: the test above), K read past
    no row's end: the attention over the same values."""
    c, k8, v8, _ = fp8_case(case, triton_device)
    d = c.q.shape[-1]
    v8 = finite_unread(v8, d)
    got = tb.paged_attention(c.q, scale_plane(k8, d), transposed(v8), c.meta, c.scale,
                             decode_config=tb.TileConfig(2, 16), num_splits=case[-1])
    kd, vd = (ta.dequantize_fp8(x, d, torch.float32) for x in (k8, v8))
    check_close(got, reference(c.q, kd, vd, c.meta, c.scale), torch.float32, case[0])


def test_decode_reads_nothing_past_the_vector_holding_the_end(triton_device):
    """The decode over 64-position tiles of a transposed V reads none of the V bytes past
    the 16-position vector that holds a row's last position: NaN there leaves the attention
    exact (on a GPU, a tile read whole would be poisoned by it; Triton's interpreter reads
    e4m3's NaN byte as 480, which weighs 0)."""
    rows = [(1, 40), (1, 70), (1, 3), (1, 128), (1, 97)]
    c, k8, v8, _ = fp8_case(("tail", rows, 4, 2, 64, 64, None, None), triton_device)
    d = c.q.shape[-1]
    v8 = v8.clone()
    for i, (_, ctx) in enumerate(rows):  # finite from the end to its vector's end only
        for p in range(ctx, -(-ctx // 16) * 16):
            blk = int(c.meta.block_tables[i, p // 64])
            v8[blk, p % 64, :, :d] = 0x7E
            v8[blk, p % 64, :, d:d + 4] = torch.tensor([1e4]).view(torch.uint8).to(v8.device)
    got = tb.paged_attention(c.q, scale_plane(k8, d), transposed(v8), c.meta, c.scale,
                             num_splits=1, decode_config=tb.TileConfig(1, 64))
    # NaN past the vector in the last tile of every row but the one ending on a tile's end
    poisoned = [ctx % 64 and -(-ctx // 16) * 16 < -(-ctx // 64) * 64 for _, ctx in rows]
    assert poisoned == [True, True, True, False, True]
    kd, vd = (ta.dequantize_fp8(x, d, torch.float32) for x in (k8, v8))
    check_close(got, reference(c.q, kd, vd, c.meta, c.scale), torch.float32, "tail")


def reference_store(seed: int, bs: int, blocks: int, tokens: int = 40, heads: int = 2,
                    dim: int = 64):
    """K/V of `tokens` tokens (K's magnitudes spread over 4 decades), their slots (every 7th
    skipped) and the row-major caches the torch reference's store leaves."""
    torch.manual_seed(seed)
    width = ta.fp8_width(dim)
    k = torch.randn(tokens, heads, dim) * torch.logspace(-2, 2, tokens)[:, None, None]
    v = torch.randn(tokens, heads, dim)
    slots = torch.randperm(blocks * bs)[:tokens]
    slots[::7] = -1
    want_k = torch.zeros(blocks, bs, heads, width, dtype=torch.uint8)
    want_v = torch.zeros_like(want_k)
    ta.store_kv(k, v, want_k, want_v, slots)
    return k, v, slots, want_k, want_v


def assert_same_bytes(got: torch.Tensor, want: torch.Tensor, dev: str, what: str) -> None:
    if dev == "cpu":
        assert torch.equal(got, want), what
    else:  # a GPU's division may round the last bit of a few quotients differently
        dim = want.shape[-1] - 16
        a, b = (ta.dequantize_fp8(x, dim, torch.float32) for x in (got, want))
        torch.testing.assert_close(a, b, rtol=0.13, atol=1e-6)


def test_store_kv_writes_the_reference_bytes(triton_device):
    """The Triton store into row-major caches, and both backends' stores into the GPU's
    layout, leave the logical bytes of the torch store into row-major caches; nothing past
    a block-head's values and scale plane is written."""
    blocks, bs, heads, dim = 8, 16, 2, 64
    k, v, slots, want_k, want_v = reference_store(3, bs, blocks)
    dev = triton_device
    got_k, got_v = torch.zeros_like(want_k, device=dev), torch.zeros_like(want_v, device=dev)
    tb.store_kv(k.to(dev), v.to(dev), got_k, got_v, slots.to(dev))
    assert_same_bytes(got_k.cpu(), want_k, dev, "K rows")
    assert_same_bytes(got_v.cpu(), want_v, dev, "V rows")
    width = want_k.shape[-1]
    for backend, dev in ((ta, "cpu"), (tb, triton_device)):
        kp = scale_plane(torch.zeros_like(want_k, device=dev), dim)
        vt = transposed(torch.zeros_like(want_v, device=dev))
        backend.store_kv(k.to(dev), v.to(dev), kp, vt, slots.to(dev))
        every = torch.arange(blocks, device=dev)
        for got, want, what in ((kp, want_k, "K"), (vt, want_v, "V")):
            assert_same_bytes(ta._blocks(got, every).cpu(), want, dev,
                              f"{backend.__name__} {what}")
        # the 8 bytes a position past the plane stay as they were: zero
        flat = kp.as_strided((blocks, heads, bs * width), (heads * bs * width, bs * width, 1))
        assert not flat[..., bs * (dim + 4):].cpu().any(), backend.__name__


def test_store_kv_writes_finite_bytes_only(triton_device):
    """NaN and infinities in K/V are stored as finite bytes (NaN as 0), by both backends: a
    V tile's positions past the context are read and weighted 0 (_load_block_tile), and
    0 * NaN would poison the row."""
    tokens, heads, dim, bs = 8, 2, 64, 16
    width = ta.fp8_width(dim)
    k = torch.randn(tokens, heads, dim)
    k[0, 0, :5] = float("nan")
    k[1, 1, 3] = float("inf")
    k[2] = float("nan")  # a whole token-head of NaN: its scale too
    slots = torch.arange(tokens)
    caches = {}
    for name, backend, dev in (("torch", ta, "cpu"), ("triton", tb, triton_device)):
        empty = torch.zeros(4, bs, heads, width, dtype=torch.uint8, device=dev)
        kc, vc = scale_plane(empty, dim), transposed(empty.clone())
        backend.store_kv(k.to(dev), k.to(dev), kc, vc, slots.to(dev))
        every = torch.arange(4, device=dev)
        caches[name] = [ta._blocks(c, every).cpu() for c in (kc, vc)]
    for kc, vc in caches.values():
        for cache in (kc, vc):
            values = ta.dequantize_fp8(cache, dim, torch.float32)
            assert torch.isfinite(values).all()
            assert values[0, 0, 0, :5].eq(0).all() and values[0, 2].eq(0).all()
    assert torch.equal(caches["torch"][0], caches["triton"][0]) or triton_device != "cpu"


def test_run_stores_write_the_reference_bytes(triton_device):
    """A prefill chunk's complete runs of 16 slots are written into a transposed V 16 bytes a
    row, each head by one of the run's first tokens' programs (triton/kv_store.py): the same
    bytes as token by token, beside partial runs, skipped tokens, a chunk starting mid-run
    and decode tokens; K's scale plane as the torch store writes it."""
    heads, dim, bs, blocks = 2, 64, 32, 8
    # a prompt of 37 from slot 0, one of 40 from slot 5 of block 3, two decode tokens, and
    # a padding token (slot -1) between them
    slots = ([*range(37)] + [-1] + [*range(3 * bs + 5, 3 * bs + 45)]
             + [6 * bs + 9, 7 * bs + 31])
    slots = torch.tensor(slots)
    torch.manual_seed(6)
    k = torch.randn(len(slots), heads, dim) * torch.logspace(-2, 2, len(slots))[:, None, None]
    v = torch.randn(len(slots), heads, dim) * torch.logspace(2, -2, len(slots))[:, None, None]
    width = ta.fp8_width(dim)
    want_k = torch.zeros(blocks, bs, heads, width, dtype=torch.uint8)
    want_v = torch.zeros_like(want_k)
    ta.store_kv(k, v, want_k, want_v, slots)
    dev = triton_device
    vt = transposed(torch.zeros_like(want_v, device=dev))
    kp = scale_plane(torch.zeros_like(want_k, device=dev), dim)
    tb.store_kv(k.to(dev), v.to(dev), kp, vt, slots.to(dev))
    every = torch.arange(blocks, device=dev)
    assert_same_bytes(ta._blocks(vt, every).cpu(), want_v, dev, "V")
    assert_same_bytes(ta._blocks(kp, every).cpu(), want_k, dev, "K")
