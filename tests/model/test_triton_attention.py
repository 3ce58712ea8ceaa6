"""Triton paged attention against the torch reference (run in fp64).

The small tests run in Triton's CPU interpreter and, marked gpu, compiled on CUDA (the
`triton_device` fixture), on fp32 shapes with small tiles, so every path (several tiles,
diagonal masks, KV splits, tiles spanning part of / several cache blocks) runs in CI. The
other tests marked gpu repeat the checks at real sizes, dtypes and block sizes.

Every cache slot a row must not read (past its context in its last block, every block it
does not own) holds NaN: a kernel that reads one key too many gives NaN, not a small error
that a half-precision tolerance could absorb. One key too few is a relative error of about
1 / context, far above fp32's tolerance: the long contexts run in fp32 at every block size.
"""

import zlib
from types import SimpleNamespace

import pytest
import torch

from nanovllm.kernels import torch_attention as ref
from nanovllm.kernels.attention_metadata import AttentionMetadata
from tests.support import triton_module

tb = triton_module("nanovllm.kernels.triton.attention")
td = triton_module("nanovllm.kernels.triton.decode")
tr = triton_module("nanovllm.kernels.triton.decode")

# relative L2 error per token: fp32 differs from fp64 by summation order only; half dtypes
# by the rounding of q, k, v and of the probabilities before the second dot
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
SMALL = tb.TileConfig(block_m=16, block_n=16)  # interpreter tiles: many tiles per row


def poison_unread(k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                  context_lens: list[int]) -> None:
    """NaN into every slot no row may read: each row reads its first context_len positions
    through its block table, nothing else."""
    num_blocks, block_size = k_cache.shape[:2]
    pos = torch.arange(tables.shape[1] * block_size)
    slots = tables.cpu().long()[:, pos // block_size] * block_size + pos % block_size
    read = pos[None, :] < torch.tensor(context_lens)[:, None]
    unread = torch.ones(num_blocks * block_size, dtype=torch.bool)
    unread[slots[read]] = False
    unread = unread.view(num_blocks, block_size).to(k_cache.device)
    k_cache[unread] = float("nan")
    v_cache[unread] = float("nan")


class Case:
    """A batch of rows (query_len, context_len) over a randomly filled, shuffled paged cache,
    every slot outside the rows' contexts NaN (`poison_unread`); block table entries past a
    row's blocks point to blocks no row owns."""

    def __init__(self, rows, num_q_heads, num_kv_heads, head_dim, block_size, device,
                 dtype=torch.float32, seed=0, extra_cols=2):
        gen = torch.Generator().manual_seed(seed)
        self.rows, self.dtype, self.device = rows, dtype, device
        qlens = [n for n, _ in rows]
        clens = [c for _, c in rows]
        needed = [-(-c // block_size) for c in clens]
        num_owned = sum(needed)
        num_blocks = num_owned + 4
        perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
        owned, spare = perm[:num_owned], perm[num_owned:]
        width = max(max(needed), 1) + extra_cols
        tables = spare[torch.arange(len(rows) * width) % len(spare)].view(len(rows), width)
        used = 0
        for i, n in enumerate(needed):
            tables[i, :n] = owned[used : used + n]
            used += n
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.randn(shape, generator=gen).to(dtype)
        self.v_cache = torch.randn(shape, generator=gen).to(dtype)
        poison_unread(self.k_cache, self.v_cache, tables, clens)
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
        return reference(self.q, self.k_cache, self.v_cache, self.meta, self.scale)

    def triton(self, **kw) -> torch.Tensor:
        return tb.paged_attention(self.q, self.k_cache, self.v_cache, self.meta, self.scale, **kw)


def reference(q, k_cache, v_cache, meta, scale) -> torch.Tensor:
    """The torch backend in fp64 on the inputs' device (quick on an H200), the poison
    zeroed: its batched decode reads whole blocks and masks by context length, and a masked
    NaN value would still give 0 * NaN."""
    q, kc, vc = (torch.nan_to_num(t.double(), nan=0.0) for t in (q, k_cache, v_cache))
    return ref.paged_attention(q, kc, vc, meta, scale).cpu()


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
def test_matches_reference(triton_device, rows, hq, hkv, d, bs, cfg, splits):
    case = Case(rows, hq, hkv, d, bs, triton_device)
    out = case.triton(prefill_config=cfg, num_splits=splits)
    check_close(out, case.reference(), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(triton_device, dtype):
    if dtype == torch.bfloat16 and triton_device == "cpu":
        pytest.skip("Triton's CPU interpreter multiplies bf16 dot operands as raw bits")
    case = Case([(1, 300), (24, 60), (1, 5), (9, 9)], 4, 2, 64, 16, triton_device, dtype)
    check_close(case.triton(prefill_config=SMALL), case.reference(), dtype)


@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_long_contexts_in_fp32(triton_device, block_size):
    """4k-token contexts at every block size the small cases use: decode rows whose context
    ends inside a block and at a block's end (the next key then lies in the next table
    entry), a prefill chunk after a long cached prefix. One key too few is a relative error
    of about 1 / 4000 here: fp32's tolerance sees it, a half-precision one would not."""
    case = Case([(1, 4100), (1, 4096), (5, 3001)], 2, 1, 32, block_size, triton_device)
    out = case.triton(prefill_config=tb.TileConfig(16, 64))  # KV tiles of 1 to 4 blocks
    check_close(out, case.reference(), torch.float32)


def test_decode_split_counts_agree(triton_device):
    # any split count is correct for any context: 1 (direct write), a few, and more splits
    # than the short rows have tiles (empty splits), as when a CUDA graph was captured for
    # a larger max_context_len
    case = Case([(1, 150), (1, 20), (1, 64)], 4, 2, 64, 16, triton_device)
    expected = case.reference()
    for splits in (1, 3, 16):
        check_close(case.triton(num_splits=splits), expected, torch.float32, f"{splits} splits")


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("block_m", [1, 2, 16])
@pytest.mark.parametrize("heads", [(4, 2), (8, 2), (4, 4)], ids=["group2", "group4", "mha"])
def test_decode_dots_over_the_group_rows_only(triton_device, heads, block_m, splits):
    """TileConfig.block_m under 16 gives the decode's dots only the GQA group's heads
    (padded to a power of 2; Triton pads the dot itself): the same attention, with and
    without splits, a padding row included."""
    case = Case([(1, 150), (1, 20), (0, 0), (1, 64)], *heads, 64, 16, triton_device)
    out = case.triton(decode_config=tb.TileConfig(block_m, 16), num_splits=splits)
    check_close(out, case.reference(), torch.float32, f"block_m={block_m}")


def test_longest_first_ranks_rows_as_a_stable_sort(triton_device):
    """The decode's row order (one ranking launch, not torch's sort) is a stable sort of the
    context lengths, longest first: ties and padding rows (length 0) keep their order."""
    gen = torch.Generator().manual_seed(5)
    for lens in ([7], [3, 9, 9, 0, 1, 9, 0], torch.randint(0, 40, (300,), generator=gen).tolist()):
        ctx = torch.tensor(lens, dtype=torch.int32, device=triton_device)
        meta = SimpleNamespace(context_lens=ctx, derived={})
        got = tr.longest_first(meta)
        want = torch.sort(ctx.cpu(), descending=True, stable=True).indices
        assert got.dtype == torch.int32 and torch.equal(got.cpu().long(), want), lens


def test_strided_q_from_fused_qkv(triton_device):
    hq, hkv, d = 4, 2, 64
    case = Case([(9, 25), (1, 30), (12, 12)], hq, hkv, d, 16, triton_device)
    t = case.q.shape[0]
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=triton_device)
    q = qkv[:, : hq * d].view(t, hq, d)
    q.copy_(case.q)
    assert not q.is_contiguous()
    out = tb.paged_attention(q, case.k_cache, case.v_cache, case.meta, case.scale,
                             prefill_config=SMALL)
    check_close(out, case.reference(), torch.float32)


def test_zero_length_query_row(triton_device):
    case = Case([(0, 10), (12, 12), (0, 0), (1, 20)], 4, 2, 64, 16, triton_device)
    check_close(case.triton(prefill_config=SMALL), case.reference(), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_store_kv_exact(triton_device, dtype):
    t, hkv, d, bs, nb = 11, 2, 64, 16, 5
    qkv = torch.randn(t, (4 + 2 * hkv) * d).to(triton_device, dtype)  # k/v: views of qkv
    k = qkv[:, 4 * d : (4 + hkv) * d].view(t, hkv, d)
    v = qkv[:, (4 + hkv) * d :].view(t, hkv, d)
    slots = torch.randperm(nb * bs)[:t]
    slots[[2, 5, 10]] = -1
    slots = slots.to(triton_device)
    ours = [torch.randn(nb, bs, hkv, d).to(triton_device, dtype) for _ in range(2)]
    theirs = [c.clone() for c in ours]
    tb.store_kv(k, v, *ours, slots)
    ref.store_kv(k, v, *theirs, slots)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


@pytest.mark.parametrize("splits", [1, 4])
def test_padded_decode_rows(triton_device, splits):
    """A CUDA-graph-style decode batch: real rows, then padding rows with context 0, a
    dummy block table and slot -1. Real rows must match the unpadded batch bit for bit,
    padding rows give finite output in their own rows only, and the cache is untouched."""
    hq, hkv, d, bs = 4, 2, 64, 16
    real = Case([(1, 70), (1, 33), (1, 5)], hq, hkv, d, bs, triton_device)
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
    bitwise = dict(rtol=0, atol=0, equal_nan=True)  # the poisoned slots are NaN
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
    assert td.choose_num_splits(256, 8, 1100) == 1  # 2048 programs already fill 132 SMs
    assert td.choose_num_splits(1, 8, 1100) == 5  # capped by >= 256 tokens per split
    assert td.choose_num_splits(4, 8, 32768) == 17  # 4 programs per SM
    assert td.choose_num_splits(1, 1, 10**6) == td.MAX_SPLITS
    assert td.choose_num_splits(1, 8, 200) == 1
    assert td.choose_num_splits(0, 8, 1000) == 1


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
GPU_BLOCK_SIZES = (16, 32, 64, 128, 256)
# every head shape at the smallest and largest block in bf16, every block size for Qwen3's
# shape in bf16 and in fp32 (a key too few at 4k+ contexts hides in bf16's tolerance, not
# in fp32's), fp16 on fewer (each combination is a fresh compile: the file should stay
# within a few minutes on one GPU)
GPU_CONFIGS = (
    [(torch.bfloat16, h, bs) for h in GPU_HEADS for bs in (16, 256)]
    + [(torch.bfloat16, GPU_HEADS[0], bs) for bs in GPU_BLOCK_SIZES[1:-1]]
    + [(torch.float16, h, 16) for h in GPU_HEADS[:3]] + [(torch.float16, GPU_HEADS[0], 256)]
    + [(torch.float32, GPU_HEADS[0], bs) for bs in GPU_BLOCK_SIZES]
    + [(torch.float32, GPU_HEADS[3], 64)]
)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", GPU_KINDS)
@pytest.mark.parametrize(
    "dtype,heads,block_size", GPU_CONFIGS,
    ids=[f"{str(dt)[6:]}-{h[0]}x{h[1]}x{h[2]}-bs{bs}" for dt, h, bs in GPU_CONFIGS],
)
def test_gpu_matches_reference(dtype, kind, heads, block_size):
    hq, hkv, d = heads
    gen = torch.Generator().manual_seed(zlib.crc32(repr((kind, heads, block_size)).encode()))
    case = Case(_gpu_rows(kind, gen), hq, hkv, d, block_size, "cuda", dtype)
    check_close(case.triton(), case.reference(), dtype, f"{kind} {heads} bs{block_size}")


@pytest.mark.gpu
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
@pytest.mark.parametrize("graph_rows,max_context", [(8, 4096), (128, 2048)])
def test_gpu_decode_cuda_graph_replay(graph_rows, max_context):
    """Capture store_kv + decode attention once for a padded batch, then replay with new
    contexts, block tables and slots copied into the static inputs; every slot past the
    new contexts NaN. The captured ranking must order each replay's rows longest first."""
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
        k_cache.normal_()
        v_cache.normal_()
        poison_unread(k_cache, v_cache, tables[:real], lens.tolist())
        graph.replay()
        torch.cuda.synchronize()
        case_meta = AttentionMetadata(
            static["slots"][:real], static["qsl"][: real + 1], static["ctx"][:real],
            static["tables"][:real], 1, int(lens.max()), [1] * real, lens.tolist(),
        )
        expected = reference(static["q"][:real], k_cache, v_cache, case_meta, scale)
        check_close(static_out[:real], expected, dtype, f"graph replay with {real} rows")
        assert torch.isfinite(static_out[real:].float()).all()
