"""The fp8 KV cache (kv_cache_dtype="fp8") in the torch backend, its reference: K/V stored as
float8 e4m3 with a scale per token and head, read back to the
query's dtype. Attention over it equals attention over the round-tripped values; the round
trip is within e4m3's spacing; the cache holds about twice the tokens of bf16's; prefix
hits, preemption and swap keep working (the scales travel with their block); on the default
model the next-token distributions stay close to the unquantized cache's. The Triton
kernels on the same cache: tests/model/test_triton_fp8.py, and end to end below."""

import pytest
import torch

from nanovllm import LLM, ConfigError, SamplingParams
from nanovllm.kernels import torch_attention as ta
from nanovllm.kernels.attention_metadata import AttentionMetadata
from tests.support import engine_logprobs, make_prompts

D = 32


def test_round_trip_is_within_e4m3_spacing():
    torch.manual_seed(0)
    width = ta.fp8_width(D)
    x = torch.randn(200, 4, D) * torch.logspace(-3, 2, 200)[:, None, None]
    raw = ta.quantize_fp8(x, width)
    assert raw.dtype == torch.uint8 and raw.shape == (200, 4, width)
    back = ta.dequantize_fp8(raw, D, torch.float32)
    scale = x.abs().amax(-1, keepdim=True) / 448  # each token-head's amax maps to 448
    bound = 2**-4 * x.abs() + scale * 2**-10
    assert bool(((back - x).abs() <= bound + 1e-12).all())


def test_attention_over_fp8_equals_attention_over_the_round_trip():
    """Prefill chunks, decodes (one row and batched) over a paged fp8 cache equal the same
    steps over a float32 cache that holds the dequantized values."""
    torch.manual_seed(1)
    width = ta.fp8_width(D)
    bs, heads, kv_heads, blocks = 4, 4, 2, 32
    fp8 = torch.zeros(blocks, bs, kv_heads, width, dtype=torch.uint8)
    fp8_v = torch.zeros_like(fp8)
    ref = torch.zeros(blocks, bs, kv_heads, D)
    ref_v = torch.zeros_like(ref)
    lens = [(9, 9), (1, 14), (1, 6), (5, 11)]  # (new tokens, context) per row
    tables = torch.randperm(blocks)[:16].view(4, 4).int()
    slots = []
    for row, (_, ctx) in enumerate(lens):
        for pos in range(ctx):
            slots.append(int(tables[row, pos // bs]) * bs + pos % bs)
    k = torch.randn(len(slots), kv_heads, D) * 3
    v = torch.randn(len(slots), kv_heads, D)
    slot_t = torch.tensor(slots)
    ta.store_kv(k, v, fp8, fp8_v, slot_t)  # the whole contexts at once
    rk = ta.dequantize_fp8(ta.quantize_fp8(k, width), D, torch.float32)
    rv = ta.dequantize_fp8(ta.quantize_fp8(v, width), D, torch.float32)
    ta.store_kv(rk, rv, ref, ref_v, slot_t)
    total = sum(n for n, _ in lens)
    q_rows = torch.randn(total, heads, D)
    starts = [0]
    for n, _ in lens:
        starts.append(starts[-1] + n)
    meta = lambda: AttentionMetadata(  # noqa: E731
        slot_mapping=torch.full((total,), -1), query_start_loc=torch.tensor(starts).int(),
        context_lens=torch.tensor([c for _, c in lens]).int(), block_tables=tables,
        max_query_len=9, max_context_len=14, query_lens_host=[n for n, _ in lens],
        context_lens_host=[c for _, c in lens])
    got = ta.paged_attention(q_rows, fp8, fp8_v, meta(), D**-0.5)
    want = ta.paged_attention(q_rows, ref, ref_v, meta(), D**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fp8_cache_holds_more_tokens(tiny_llama):
    sizes = {}
    for name, opts in {"auto": {}, "token": dict(kv_cache_dtype="fp8")}.items():
        llm = LLM(str(tiny_llama), device="cpu", dtype="bfloat16", kv_cache_gib=0.01, **opts)
        sizes[name] = llm.engine.config.num_kv_blocks
    # head_dim 16 + a 4-byte scale, padded to 32 bytes: as many bytes as bf16 at this tiny
    # head_dim; at 64 it is 80 bytes against 128, at 128 144 against 256
    assert ta.fp8_width(16) == 32 and ta.fp8_width(64) == 80
    assert ta.fp8_width(128) == 144
    assert sizes["token"] == pytest.approx(sizes["auto"] * 32 / 32, rel=0.01)


PREEMPT = dict(num_kv_blocks=24, block_size=4, max_model_len=96, max_num_seqs=8,
               admission_headroom=0)


def test_fp8_swap_round_trip_changes_nothing(tiny_llama):
    """The scales travel with their block: a preempted sequence's blocks swapped to host
    memory and back give the tokens a roomy cache gives. (A recompute or a prefix hit may
    not: a prefill reads its own positions unrounded and the ones before it from the cache,
    so an fp8 engine's tokens depend, within fp8 rounding, on where chunks begin.)"""
    prompts = make_prompts(seed=2, count=8, shared_prefix=0)  # no block shared: no hits
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    opts = dict(device="cpu", kv_cache_dtype="fp8")
    roomy = LLM(str(tiny_llama), num_kv_blocks=512, enable_prefix_caching=False, **opts)
    assert roomy.engine.runner.kernels.fresh_prefill
    expected = [o.token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(tiny_llama), **opts, **PREEMPT, swap_space=0.01, preemption_mode="swap")
    got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == llm.engine.config.num_kv_blocks


def test_fp8_on_the_default_model_stays_close(default_dense):
    """Teacher-forced next-token distributions of the default model (float32) with an fp8
    cache against its float32 cache: mean KL under 2e-2 nats per token (the benchmark
    measures 6e-3 against a bf16 cache, BENCHMARKS.md). The generated tokens are scored by
    decode steps: a prefill reads its own positions unrounded (Kernels.fresh_prefill), so
    it would say nothing of the cache."""
    base = default_dense
    fp8 = LLM(weight_format="dense", max_model_len=512, kv_cache_gib=0.1, kv_cache_dtype="fp8")
    chat = base.engine.render_chat([{"role": "user", "content": "How does a rainbow form?"}])
    ids = chat + base.generate([chat], SamplingParams(temperature=0, max_tokens=32),
                               use_tqdm=False)[0].token_ids
    ref, got = (engine_logprobs(llm, ids, prefill=len(chat)) for llm in (base, fp8))
    kl = (ref.exp() * (ref - got)).sum(-1)[len(chat) - 1 :]
    assert float(kl.mean()) < 2e-2, float(kl.mean())


def test_fp8_settings_say_what_to_change(tiny_llama):
    with pytest.raises(ConfigError, match="kv_cache_dtype='fp16' is invalid"):
        LLM(str(tiny_llama), device="cpu", kv_cache_dtype="fp16")


@pytest.mark.parametrize("block_size", [8, 32], ids=["k-by-position", "k-scale-plane"])
def test_triton_engine_on_fp8_equals_the_torch_one(tiny_llama, triton_device, block_size):
    """The whole engine with the Triton kernels (on a CPU in Triton's interpreter) on an fp8
    cache: the bytes the reference stores, the attention it computes, so the same tokens;
    with blocks under 16 tokens in rows, and from 16 on with V transposed and K head-major
    with its scales in a plane (a prefill's V stored by runs), as every kernel and the
    reference index the cache by its strides. Shared prefixes are cached and prompts come
    in chunks, so prefill rows read their own positions from the step's K/V and the earlier
    ones from the cache."""
    # two prompts (32 and 44 tokens) in chunks of 24: the second one's prefix hits the
    # first's blocks of 8, and its chunks share steps with the first one's decodes
    prompts = make_prompts(seed=4, count=2, shared_prefix=20)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(tiny_llama), device=triton_device, dtype="float32", enforce_eager=True,
                  kv_cache_dtype="fp8", num_kv_blocks=64, block_size=block_size,
                  max_num_batched_tokens=24, attention_backend=backend)
        k = llm.engine.runner.model.attention_layers()[0].k_cache
        head_dim = llm.engine.model_config.head_dim
        plane = block_size >= 16
        # a position's values only: a scale plane; else rows of every head
        assert k.stride(1) == (head_dim if plane else k.shape[-1] * k.shape[2])
        assert ta.k_scale_plane(k) == plane
        outs[backend] = llm.generate(prompts, params, use_tqdm=False)
        assert outs[backend][1].num_cached_tokens == (16 if block_size == 8 else 0)
    for a, b in zip(outs["torch"], outs["triton"]):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert all(abs(la[k] - lb[k]) < 1e-4 for k in la)
    plain = LLM(str(tiny_llama), device="cpu", num_kv_blocks=64)
    assert not plain.engine.runner.kernels.fresh_prefill  # its cache holds the values as computed
