"""Triton paged attention against the torch reference (run in fp64).

Without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set here and
in conftest.py before triton loads) on small fp32 shapes with small tiles, so every path
(several tiles, diagonal masks, KV splits, tiles spanning part of / several cache blocks)
runs in CI. Tests marked gpu repeat the checks at real sizes, dtypes and block sizes.
"""

import importlib
import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
tb = importlib.import_module("nanovllm.kernels.triton_attention")
ref = importlib.import_module("nanovllm.kernels.torch_attention")
AttentionMetadata = importlib.import_module("nanovllm.kernels.attention_metadata").AttentionMetadata

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"  # the small tests run compiled on a GPU machine
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
SMALL = tb.TileConfig(block_m=16, block_n=16)  # interpreter tiles: many tiles per row


class Case:
    """A batch of rows (query_len, context_len) over a randomly filled, shuffled paged cache.

    Block table entries past a row's context point to a block of NaNs, so any read past
    the context that reaches the output shows up as NaN.
    """

    def __init__(self, rows, num_q_heads, num_kv_heads, head_dim, block_size,
                 dtype=torch.float32, device=DEVICE, seed=0, extra_cols=2):
        gen = torch.Generator().manual_seed(seed)
        self.rows, self.dtype, self.device = rows, dtype, device
        qlens = [n for n, _ in rows]
        clens = [c for _, c in rows]
        needed = [-(-c // block_size) for c in clens]
        num_blocks = sum(needed) + 4
        self.poison = poison = num_blocks - 1
        width = max(max(needed), 1) + extra_cols
        perm = torch.randperm(num_blocks - 1, generator=gen)
        tables = torch.full((len(rows), width), poison, dtype=torch.int32)
        used = 0
        for i, n in enumerate(needed):
            tables[i, :n] = perm[used : used + n].to(torch.int32)
            used += n
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.randn(shape, generator=gen).to(dtype)
        self.v_cache = torch.randn(shape, generator=gen).to(dtype)
        self.k_cache[poison] = float("nan")
        self.v_cache[poison] = float("nan")
        self.q = torch.randn(sum(qlens), num_q_heads, head_dim, generator=gen).to(dtype)
        starts = [0]
        for n in qlens:
            starts.append(starts[-1] + n)
        self.meta = AttentionMetadata(
            slot_mapping=torch.full((sum(qlens),), -1, dtype=torch.int64),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            context_lens=torch.tensor(clens, dtype=torch.int32),
            block_tables=tables,
            max_query_len=max(qlens),
            max_context_len=max(clens),
            query_lens_host=qlens,
            context_lens_host=clens,
        )
        self.scale = head_dim**-0.5
        self.to(device)

    def to(self, device):
        m = self.meta
        self.q, self.k_cache, self.v_cache = (
            t.to(device) for t in (self.q, self.k_cache, self.v_cache)
        )
        for name in ("slot_mapping", "query_start_loc", "context_lens", "block_tables"):
            setattr(m, name, getattr(m, name).to(device))
        return self

    def reference(self) -> torch.Tensor:
        """The torch backend in fp64, on the case's device (fp64 on an H200 is quick)."""
        q, kc, vc = (t.double() for t in (self.q, self.k_cache, self.v_cache))
        kc[self.poison] = 0  # the reference's batched decode reads (and masks) past contexts
        vc[self.poison] = 0
        return ref.paged_attention(q, kc, vc, self.meta, self.scale).cpu()

    def triton(self, **kw) -> torch.Tensor:
        return tb.paged_attention(self.q, self.k_cache, self.v_cache, self.meta, self.scale, **kw)


def check_close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str = ""):
    """Worst per-token relative error (L2 over heads and dims) against the fp64 reference."""
    assert not torch.isnan(out).any(), f"{what}: NaN in output"
    out = out.to("cpu", torch.float64)
    err = (out - expected).flatten(1).norm(dim=1) / expected.flatten(1).norm(dim=1).clamp_min(1e-6)
    worst = err.max().item() if err.numel() else 0.0
    assert worst < TOL[dtype], f"{what}: relative error {worst:.2e} >= {TOL[dtype]:.0e}"
    return worst


# (id, rows (query_len, context_len), Hq, Hkv, head_dim, block_size, prefill cfg, num_splits)
CPU_CASES = [
    ("prefill-ragged-g1", [(37, 37), (5, 5), (20, 20)], 2, 2, 64, 16, SMALL, None),
    ("prefix-hit-g2-bs32", [(13, 50), (30, 47), (7, 7)], 4, 2, 64, 32,
     tb.TileConfig(32, 16), None),
    ("decode-g4", [(1, 40), (1, 70), (1, 3), (1, 16)], 8, 2, 64, 16, None, None),
    ("decode-split-g8", [(1, 300), (1, 700), (1, 1), (1, 257)], 8, 1, 64, 16, None, None),
    ("decode-many-splits", [(1, 90), (1, 33)], 4, 2, 64, 32, None, 8),
    ("mixed-g2", [(1, 90), (24, 60), (1, 5), (9, 9), (1, 400)], 4, 2, 64, 16,
     tb.TileConfig(16, 32), None),
    ("d128-g8-bs64-partial-block-tiles", [(17, 40), (1, 33), (3, 70)], 16, 2, 128, 64,
     SMALL, None),
    ("d96-g2", [(10, 30), (1, 45), (20, 20)], 4, 2, 96, 16, SMALL, None),
    ("g4-default-tiles", [(40, 100), (1, 60), (70, 70)], 4, 1, 64, 16, None, None),
    # every prefix length mod the KV tile: the unmasked/diagonal tile boundary is exact
    ("prefix-alignment-sweep", [(5, 5 + p) for p in range(17)]
     + [(20, 20 + p) for p in range(0, 17, 3)], 2, 2, 64, 16, SMALL, None),
]


@pytest.mark.parametrize(
    "rows,hq,hkv,d,bs,cfg,splits", [c[1:] for c in CPU_CASES], ids=[c[0] for c in CPU_CASES]
)
def test_matches_reference(rows, hq, hkv, d, bs, cfg, splits):
    case = Case(rows, hq, hkv, d, bs)
    out = case.triton(prefill_config=cfg, num_splits=splits)
    check_close(out, case.reference(), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    if dtype == torch.bfloat16 and not HAS_CUDA:
        pytest.skip("Triton's CPU interpreter multiplies bf16 dot operands as raw bits")
    case = Case([(1, 300), (24, 60), (1, 5), (9, 9)], 4, 2, 64, 16, dtype)
    check_close(case.triton(prefill_config=SMALL), case.reference(), dtype)


def test_decode_split_counts_agree():
    # any split count is correct for any context: 1 (direct write), a few, and more splits
    # than the short rows have tiles (empty splits), as when a CUDA graph was captured for
    # a larger max_context_len
    case = Case([(1, 150), (1, 20), (1, 64)], 4, 2, 64, 16)
    expected = case.reference()
    for splits in (1, 3, 16):
        check_close(case.triton(num_splits=splits), expected, torch.float32, f"{splits} splits")


def test_strided_q_from_fused_qkv():
    hq, hkv, d = 4, 2, 64
    case = Case([(9, 25), (1, 30), (12, 12)], hq, hkv, d, 16)
    t = case.q.shape[0]
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=DEVICE)
    q = qkv[:, : hq * d].view(t, hq, d)
    q.copy_(case.q)
    assert not q.is_contiguous()
    out = tb.paged_attention(q, case.k_cache, case.v_cache, case.meta, case.scale,
                             prefill_config=SMALL)
    check_close(out, case.reference(), torch.float32)


def test_zero_length_query_row():
    case = Case([(0, 10), (12, 12), (0, 0), (1, 20)], 4, 2, 64, 16)
    check_close(case.triton(prefill_config=SMALL), case.reference(), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_store_kv_exact(dtype):
    t, hkv, d, bs, nb = 11, 2, 64, 16, 5
    qkv = torch.randn(t, (4 + 2 * hkv) * d).to(DEVICE, dtype)  # k/v: strided views of qkv
    k = qkv[:, 4 * d : (4 + hkv) * d].view(t, hkv, d)
    v = qkv[:, (4 + hkv) * d :].view(t, hkv, d)
    slots = torch.randperm(nb * bs)[:t]
    slots[[2, 5, 10]] = -1
    slots = slots.to(DEVICE)
    ours = [torch.randn(nb, bs, hkv, d).to(DEVICE, dtype) for _ in range(2)]
    theirs = [c.clone() for c in ours]
    tb.store_kv(k, v, *ours, slots)
    ref.store_kv(k, v, *theirs, slots)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


@pytest.mark.parametrize("splits", [1, 4])
def test_padded_decode_rows(splits):
    """A CUDA-graph-style decode batch: real rows, then padding rows with context 0, a
    dummy block table and slot -1. Real rows must match the unpadded batch bit for bit,
    padding rows give finite output in their own rows only, and the cache is untouched."""
    hq, hkv, d, bs = 4, 2, 64, 16
    real = Case([(1, 70), (1, 33), (1, 5)], hq, hkv, d, bs)
    alone = real.triton(num_splits=splits)

    pad = 3
    m = real.meta
    dev = real.q.device
    tables = torch.cat([m.block_tables, torch.zeros(pad, m.block_tables.shape[1],
                                                    dtype=torch.int32, device=dev)])
    meta = AttentionMetadata(
        slot_mapping=torch.cat([torch.arange(3) + 7, torch.full((pad,), -1)]).to(dev),
        query_start_loc=torch.arange(3 + pad + 1, dtype=torch.int32, device=dev),
        context_lens=torch.cat([m.context_lens,
                                torch.zeros(pad, dtype=torch.int32, device=dev)]),
        block_tables=tables, max_query_len=1, max_context_len=m.max_context_len,
        query_lens_host=[1] * (3 + pad), context_lens_host=m.context_lens_host + [0] * pad,
    )
    q = torch.cat([real.q, torch.full((pad, hq, d), 1e4, device=dev)])  # huge padding queries
    k_new = torch.randn(3 + pad, hkv, d, device=dev)
    v_new = torch.randn(3 + pad, hkv, d, device=dev)
    k_cache, v_cache = real.k_cache.clone(), real.v_cache.clone()
    k_before, v_before = k_cache.clone(), v_cache.clone()
    tb.store_kv(k_new, v_new, k_cache, v_cache, meta.slot_mapping)
    written = torch.zeros(k_cache.shape[0] * bs, dtype=torch.bool, device=dev)
    written[7:10] = True
    flat_k, flat_kb = k_cache.view(-1, hkv, d), k_before.view(-1, hkv, d)
    bitwise = dict(rtol=0, atol=0, equal_nan=True)  # the cache's poison block is NaN
    torch.testing.assert_close(flat_k[~written], flat_kb[~written], **bitwise)
    torch.testing.assert_close(v_cache.view(-1, hkv, d)[~written],
                               v_before.view(-1, hkv, d)[~written], **bitwise)
    assert torch.equal(flat_k[7:10], k_new[:3])

    out = tb.paged_attention(q, real.k_cache, real.v_cache, meta, real.scale,
                             num_splits=splits)
    assert torch.equal(out[:3], alone)
    assert (out[3:] == 0).all()  # an empty context attends to nothing: zeros, not NaN

    # padding rows with query_len 0 (query_start_loc repeats): nothing is written for them
    meta.query_start_loc = torch.tensor([0, 1, 2, 3, 3, 3, 3], dtype=torch.int32, device=dev)
    meta.query_lens_host = [1, 1, 1, 0, 0, 0]
    out = tb.paged_attention(real.q, real.k_cache, real.v_cache, meta, real.scale,
                             num_splits=splits)
    assert torch.equal(out, alone)


def test_choose_num_splits():
    assert tb.choose_num_splits(256, 8, 1100) == 1  # 2048 programs already fill 132 SMs
    assert tb.choose_num_splits(1, 8, 1100) == 5  # capped by >= 256 tokens per split
    assert tb.choose_num_splits(4, 8, 32768) == 17  # 4 programs per SM
    assert tb.choose_num_splits(1, 1, 10**6) == tb.MAX_SPLITS
    assert tb.choose_num_splits(1, 8, 200) == 1
    assert tb.choose_num_splits(0, 8, 1000) == 1


# ---------------------------------------------------------------------------------------
# GPU: real sizes, bf16/fp16, large cache blocks, default tiles


def _gpu_rows(kind: str, gen: torch.Generator) -> list[tuple[int, int]]:
    r = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=gen))
    if kind == "prefill":
        return [(n, n) for n in (r(1, 40), r(200, 700), r(60, 130), 512, 1)]
    if kind == "prefix":
        return [(q, q + r(1, 900)) for q in (r(1, 64), r(100, 400), 256, 17)]
    if kind == "decode":
        return [(1, r(1, 1500)) for _ in range(37)] + [(1, 4100)]
    if kind == "decode-small-batch":  # the split path with long contexts
        return [(1, r(3000, 9000)) for _ in range(3)]
    return [(1, r(1, 2000)) for _ in range(20)] + [(r(2, 300), r(300, 1200)) for _ in range(3)]


GPU_KINDS = ["prefill", "prefix", "decode", "decode-small-batch", "mixed"]
# (Hq, Hkv, head_dim): Qwen3-0.6B, GQA 8, MHA d64, GQA 4 d64, GQA 8 non-power-of-2 d96
GPU_HEADS = [(16, 8, 128), (32, 4, 128), (8, 8, 64), (16, 4, 64), (24, 3, 96)]
# every head shape at the smallest and largest block in bf16, every block size for Qwen3's
# shape, fp16 and fp32 on fewer (each combination is a fresh compile: the file should stay
# within a few minutes on one GPU)
GPU_CONFIGS = (
    [(torch.bfloat16, h, bs) for h in GPU_HEADS for bs in (16, 256)]
    + [(torch.bfloat16, GPU_HEADS[0], bs) for bs in (32, 64, 128)]
    + [(torch.float16, h, 16) for h in GPU_HEADS[:3]] + [(torch.float16, GPU_HEADS[0], 256)]
    + [(torch.float32, GPU_HEADS[0], 16), (torch.float32, GPU_HEADS[3], 64)]
)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kind", GPU_KINDS)
@pytest.mark.parametrize(
    "dtype,heads,block_size", GPU_CONFIGS,
    ids=[f"{str(dt)[6:]}-{h[0]}x{h[1]}x{h[2]}-bs{bs}" for dt, h, bs in GPU_CONFIGS],
)
def test_gpu_matches_reference(dtype, kind, heads, block_size):
    hq, hkv, d = heads
    gen = torch.Generator().manual_seed(zlib.crc32(repr((kind, heads, block_size)).encode()))
    case = Case(_gpu_rows(kind, gen), hq, hkv, d, block_size, dtype, "cuda")
    check_close(case.triton(), case.reference(), dtype, f"{kind} {heads} bs{block_size}")


@pytest.mark.gpu
@gpu
def test_gpu_store_kv_exact():
    t, hkv, d, bs = 300, 8, 128, 16
    k = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    slots = torch.randperm(64 * bs, device="cuda")[:t]
    slots[::7] = -1
    ours = [torch.randn(64, bs, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    theirs = [c.clone() for c in ours]
    tb.store_kv(k, v, *ours, slots)
    ref.store_kv(k, v, *theirs, slots)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("graph_rows,max_context", [(8, 4096), (128, 2048)])
def test_gpu_decode_cuda_graph_replay(graph_rows, max_context):
    """Capture store_kv + decode attention once for a padded batch, then replay with new
    contexts, block tables and slots copied into the static inputs."""
    hq, hkv, d, bs = 16, 8, 128, 16
    dtype, dev = torch.bfloat16, "cuda"
    width = max_context // bs
    num_blocks = graph_rows * width + 1
    k_cache = torch.randn(num_blocks, bs, hkv, d, device=dev, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    static = dict(
        q=torch.zeros(graph_rows, hq, d, device=dev, dtype=dtype),
        k=torch.zeros(graph_rows, hkv, d, device=dev, dtype=dtype),
        v=torch.zeros(graph_rows, hkv, d, device=dev, dtype=dtype),
        slots=torch.full((graph_rows,), -1, device=dev, dtype=torch.int64),
        qsl=torch.arange(graph_rows + 1, device=dev, dtype=torch.int32),
        ctx=torch.zeros(graph_rows, device=dev, dtype=torch.int32),
        tables=torch.zeros(graph_rows, width, device=dev, dtype=torch.int32),
    )
    meta = AttentionMetadata(static["slots"], static["qsl"], static["ctx"], static["tables"],
                             1, max_context, [1] * graph_rows, [0] * graph_rows)
    scale = d**-0.5

    def step():
        tb.store_kv(static["k"], static["v"], k_cache, v_cache, static["slots"])
        return tb.paged_attention(static["q"], k_cache, v_cache, meta, scale)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()

    gen = torch.Generator().manual_seed(graph_rows)
    for real in (graph_rows, graph_rows // 2 + 1, 1):
        lens = torch.randint(1, max_context + 1, (real,), generator=gen)
        perm = torch.randperm(num_blocks - 1, generator=gen)
        tables = torch.zeros(graph_rows, width, dtype=torch.int32)
        tables[:real] = perm[: real * width].view(real, width).to(torch.int32)
        slots = torch.full((graph_rows,), -1, dtype=torch.int64)
        for i in range(real):
            last = int(lens[i]) - 1
            slots[i] = int(tables[i, last // bs]) * bs + last % bs
        static["ctx"].zero_()
        static["ctx"][:real] = lens.to(dev, torch.int32)
        static["tables"].copy_(tables)
        static["slots"].copy_(slots)
        static["q"].normal_()
        static["k"].normal_()
        static["v"].normal_()
        graph.replay()
        torch.cuda.synchronize()
        case_meta = AttentionMetadata(
            static["slots"][:real], static["qsl"][: real + 1], static["ctx"][:real],
            static["tables"][:real], 1, int(lens.max()), [1] * real, lens.tolist(),
        )
        expected = ref.paged_attention(static["q"][:real].double(), k_cache.double(),
                                       v_cache.double(), case_meta, scale).cpu()
        check_close(static_out[:real], expected, dtype, f"graph replay with {real} rows")
        assert torch.isfinite(static_out[real:].float()).all()
