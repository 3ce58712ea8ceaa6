"""The CPU's native kernels (kernels/cpu_native.c, built by cpu_native.py with the system's C
compiler) against the torch backend they stand in for (torch_ops.py, torch_attention.py),
what they hand back to it, how an engine comes to run them, and an engine running them
against transformers."""

import logging
import os
import subprocess
import sys

import pytest
import torch

from nanovllm import LLM
from nanovllm.core.config import EngineConfig
from nanovllm.core.errors import ConfigError
from nanovllm.kernels import cpu_native as native
from nanovllm.kernels import select_kernels
from nanovllm.kernels import torch_attention as ref_attn
from nanovllm.kernels import torch_ops as ref
from nanovllm.kernels.attention_metadata import AttentionMetadata
from tests.support import greedy, hf_greedy, make_prompts

pytestmark = pytest.mark.skipif(bool(native.available()),
                                reason=f"no native CPU kernels here: {native.available()}")
TOL = dict(atol=2e-5, rtol=2e-5)  # float32, another summation order


def randn(*shape, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return scale * torch.randn(*shape, generator=gen)


@pytest.mark.parametrize("rows,n", [(1, 576), (5, 64), (3, 100)])
def test_norms_match_torch(rows, n):
    x = randn(rows, n + 7, seed=1)[:, 3:3 + n]  # rows of a wider tensor: strided
    residual = randn(rows, n, seed=2)
    w = 1 + 0.1 * randn(n, seed=3)
    torch.testing.assert_close(native.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), **TOL)
    want_out, want_res = ref.add_rms_norm(x, residual.clone(), w, 1e-6)
    out, res = native.add_rms_norm(x, residual, w, 1e-6)
    assert res is residual, "the sum goes into the residual in place, as Triton's does"
    torch.testing.assert_close(out, want_out, **TOL)
    torch.testing.assert_close(res, want_res, **TOL)


@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3-norms"])
@pytest.mark.parametrize("dim", [64, 128])
def test_rope_matches_torch_in_place_on_views(qk_norm, dim):
    tokens, hq, hk = 5, 6, 2
    qkv = randn(tokens, (hq + 2 * hk) * dim, seed=4)  # q and k are views, as in the model
    q, k, _ = qkv.split([hq * dim, hk * dim, hk * dim], dim=-1)
    q, k = q.view(tokens, hq, dim), k.view(tokens, hk, dim)
    positions = torch.tensor([0, 7, 1, 300, 511])
    freqs = torch.outer(torch.arange(512).float(), 1 / 10000 ** (torch.arange(0, dim, 2) / dim))
    cos, sin = freqs.cos(), freqs.sin()
    norms = (1 + 0.1 * randn(dim, seed=5), 1 + 0.1 * randn(dim, seed=6)) if qk_norm else ()
    want_q, want_k = ref.qk_norm_rope(q.clone(), k.clone(), positions, cos, sin, *norms)
    before = qkv.clone()
    got_q, got_k = native.qk_norm_rope(q, k, positions, cos, sin, *norms)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    torch.testing.assert_close(got_q, want_q, **TOL)
    torch.testing.assert_close(got_k, want_k, **TOL)
    v_cols = slice((hq + hk) * dim, None)
    assert torch.equal(qkv[:, v_cols], before[:, v_cols]), "v untouched"


def test_silu_and_mul_matches_torch():
    x = randn(4, 2 * 96 + 5, seed=7)[:, : 2 * 96]
    torch.testing.assert_close(native.silu_and_mul(x), ref.silu_and_mul(x), **TOL)


def paged(rows: list[int], heads: int, dim: int, block_size: int, seed: int = 0):
    """A shuffled paged cache holding contexts of `rows` tokens; (k_cache, v_cache, tables,
    lens)."""
    blocks = [-(-n // block_size) for n in rows]
    perm = torch.randperm(sum(blocks) + 3, generator=torch.Generator().manual_seed(seed))
    tables = torch.zeros(len(rows), max(blocks) + 1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = perm[used:used + n]
        used += n
    shape = (sum(blocks) + 3, block_size, heads, dim)
    k_cache, v_cache = randn(*shape, seed=seed + 1), randn(*shape, seed=seed + 2)
    return k_cache, v_cache, tables, torch.tensor(rows, dtype=torch.int32)


def meta_for(query_lens, tables, lens, slots=None) -> AttentionMetadata:
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    tokens = starts[-1]
    return AttentionMetadata(
        slot_mapping=slots if slots is not None else torch.full((tokens,), -1),
        query_start_loc=torch.tensor(starts, dtype=torch.int32), context_lens=lens,
        block_tables=tables, max_query_len=max(query_lens), max_context_len=int(lens.max()),
        query_lens_host=list(query_lens), context_lens_host=lens.tolist())


@pytest.mark.parametrize("hq,hk,dim", [(4, 4, 64), (9, 3, 64), (8, 2, 128), (4, 2, 80)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_decode_attention_matches_torch(hq, hk, dim, block_size):
    rows = [1, block_size, block_size + 1, 3 * block_size - 1, 200]
    k_cache, v_cache, tables, lens = paged(rows, hk, dim, block_size, seed=hq + dim)
    q = randn(len(rows), hq + 1, dim, seed=9)[:, 1:]  # strided heads
    meta = meta_for([1] * len(rows), tables, lens)
    want = ref_attn.paged_attention(q, k_cache, v_cache, meta, dim ** -0.5)
    torch.testing.assert_close(native.paged_attention(q, k_cache, v_cache, meta, dim ** -0.5),
                               want, **TOL)


def test_a_step_with_prompt_tokens_is_the_torch_backends():
    k_cache, v_cache, tables, lens = paged([6, 9], 2, 64, 4)
    q = randn(4, 4, 64, seed=10)  # row 0 decodes, row 1 has 3 prompt tokens
    meta = meta_for([1, 3], tables, lens)
    want = ref_attn.paged_attention(q, k_cache, v_cache, meta, 0.125)
    assert torch.equal(native.paged_attention(q, k_cache, v_cache, meta, 0.125), want)


def test_store_kv_matches_torch_and_skips_padding():
    k, v = randn(4, 3, 64, seed=11), randn(4, 3, 64, seed=12)
    slots = torch.tensor([5, -1, 0, 17])
    caches = [torch.zeros(5, 4, 3, 64) for _ in range(4)]
    ref_attn.store_kv(k, v, caches[0], caches[1], slots)
    native.store_kv(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])


def test_indices_past_the_cache_raise_before_touching_memory():
    # the engine never makes them; a bug that did gets the torch backend's IndexError, not a
    # write or read past the cache
    k_cache, v_cache, tables, lens = paged([6, 9], 2, 64, 4)
    q = randn(2, 4, 64, seed=14)
    tables[1, 1] = k_cache.shape[0]  # a block past the cache
    with pytest.raises(IndexError, match="do not fit block tables"):
        native.paged_attention(q, k_cache, v_cache, meta_for([1, 1], tables, lens), 0.125)
    with pytest.raises(IndexError, match="do not fit block tables"):  # longer than its table
        native.paged_attention(q, k_cache, v_cache,
                               meta_for([1, 1], tables[:, :1], torch.tensor([6, 2],
                                                                         dtype=torch.int32)),
                               0.125)
    caches = [c.clone() for c in (k_cache, v_cache)]
    with pytest.raises(IndexError, match="outside the cache"):
        native.store_kv(q[:, :2], q[:, 2:], *caches,
                        torch.tensor([3, k_cache.shape[0] * k_cache.shape[1]]))
    assert torch.equal(caches[0], k_cache) and torch.equal(caches[1], v_cache)


def test_what_the_c_does_not_take_goes_to_torch():
    x = randn(3, 64, seed=13).bfloat16()
    w = torch.ones(64, dtype=torch.bfloat16)
    assert torch.equal(native.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
    assert torch.equal(native.silu_and_mul(x), ref.silu_and_mul(x))


def test_the_library_is_built_once_into_the_cache_and_a_failed_build_says_why(tmp_path):
    env = dict(os.environ, NANOVLLM_CACHE=str(tmp_path))
    code = "from nanovllm.kernels import cpu_native as n; print(repr(n.available()))"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.stdout.strip() == "''", run.stderr
    assert len(list(tmp_path.glob("cpu_native-*.so"))) == 1
    env.update(NANOVLLM_CACHE=str(tmp_path / "other"), CC="/bin/false")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert "/bin/false" in run.stdout and "failed" in run.stdout, run.stdout + run.stderr
    (tmp_path / "file").write_text("")  # a cache "directory" that cannot be made
    env.update(NANOVLLM_CACHE=str(tmp_path / "file" / "cache"), CC="cc")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert "cannot build into" in run.stdout and "NANOVLLM_CACHE" in run.stdout, run.stdout


def test_a_cpu_engine_runs_them_by_default_and_says_when_it_cannot(monkeypatch, caplog):
    from nanovllm.engine.resolve import resolve_config
    from nanovllm.model.config import ModelConfig

    model = ModelConfig.from_hf({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "max_position_embeddings": 128,
    })
    cfg = resolve_config(EngineConfig(device="cpu"), model)
    assert (cfg.kernels, cfg.attention_backend) == ("native", "native")
    off = resolve_config(EngineConfig(device="cpu", native_kernels=False), model)
    assert (off.kernels, off.attention_backend) == ("torch", "torch")
    bf16 = resolve_config(EngineConfig(device="cpu", dtype="bfloat16"), model)
    assert bf16.kernels == "torch"
    with pytest.raises(ConfigError, match="float32"):
        resolve_config(EngineConfig(device="cpu", dtype="bfloat16",
                                    native_kernels=True), model)
    monkeypatch.setattr(native, "available", lambda: "no C compiler found")
    with caplog.at_level(logging.WARNING, logger="nanovllm"):
        cfg = resolve_config(EngineConfig(device="cpu"), model)
    assert cfg.kernels == "torch" and "no C compiler found" in caplog.text
    with pytest.raises(ConfigError, match="no C compiler found"):
        resolve_config(EngineConfig(device="cpu", native_kernels=True), model)
    assert select_kernels("native", "native").paged_attention is native.paged_attention


def test_engine_with_native_kernels_matches_transformers(tiny_model, hf_tiny_model):
    # a mixed prefill + decode batch (3 prompts, a small step budget), then decode steps
    llm = LLM(str(tiny_model), device="cpu", block_size=4, num_kv_blocks=64, max_num_seqs=4,
              max_num_batched_tokens=16)
    assert "kernels=native attention=native" in llm.engine.config.summary()
    prompts = make_prompts(seed=5, count=3)
    out = [o.token_ids for o in llm.generate(prompts, greedy(6), use_tqdm=False)]
    assert out == [hf_greedy(hf_tiny_model, p, 6) for p in prompts]
