"""`fp8_attention` ("q" | "qp") on an fp8 cache: an engine's attention in the numerics of the
fp8 tensor-core kernels (kernels/triton_fp8_decode.py and triton_attention's prefill; the
torch backend states them,
`torch_attention.fp8_decode_reference`). The Triton engine (on a CPU in Triton's
interpreter, marked gpu on CUDA) gives the torch engine's tokens and logprobs; the numerics
move the logprobs a little from the converting kernels'; settings that cannot work say what
to change."""

import pytest

from nanovllm import LLM, ConfigError, SamplingParams
from tests.support import build_tiny_model, make_prompts


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-fp8-attention"), "qwen3")


def generate(path, device, mode, backend="torch", **extra):
    llm = LLM(str(path), device=device, dtype="float32", enforce_eager=True,
              kv_cache_dtype="fp8", fp8_attention=mode, num_kv_blocks=24, block_size=128,
              attention_backend=backend, **extra)
    prompts = make_prompts(seed=5, count=3, shared_prefix=4)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    return llm, llm.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("mode", ["q", "qp"])
def test_triton_engine_equals_the_torch_one(tiny_qwen3, triton_device, mode):
    _, torch_outs = generate(tiny_qwen3, triton_device, mode)
    llm, triton_outs = generate(tiny_qwen3, triton_device, mode, backend="triton")
    assert llm.engine.config.fp8_attention == mode
    assert f"fp8 attention {mode}" in llm.engine.config.summary()
    tolerance = 3e-2 if mode == "qp" and triton_device == "cuda" else 1e-2
    for a, b in zip(torch_outs, triton_outs):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            # the same numerics; now and then a rounding of P to e4m3 (steps of 1/8 of the
            # value) falls the other way, more often on a GPU, whose exp2 is approximate:
            # 0.010 there at qp (1x H200)
            assert all(abs(la[k] - lb[k]) < tolerance for k in la), (la, lb)


@pytest.mark.parametrize("mode", ["q", "qp"])
def test_the_numerics_move_logprobs_a_little(tiny_qwen3, mode, monkeypatch):
    import nanovllm.kernels as kernels

    # the converting kernels reading the cache as fp8_attention's do, prefill rows too
    # (kernels.FRESH_PREFILL off), so only the numerics differ
    monkeypatch.setattr(kernels, "FRESH_PREFILL", False)
    _, off = generate(tiny_qwen3, "cpu", "off")
    _, on = generate(tiny_qwen3, "cpu", mode)
    diffs = [abs(x[k] - y[k]) for a, b in zip(off, on)
             for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs) for k in x if k in y]
    assert 0.0 < max(diffs) < 0.3, max(diffs)


def test_the_triton_engine_gets_the_blocks_it_needs(tiny_qwen3, triton_interpreter):
    # no block_size given: 128-token blocks, on a CPU too (Triton's interpreter)
    llm = LLM(str(tiny_qwen3), device="cpu", dtype="float32", enforce_eager=True,
              kv_cache_dtype="fp8", fp8_attention="q", num_kv_blocks=24,
              attention_backend="triton")
    assert llm.engine.config.block_size == 128
    out = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=2, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].token_ids) == 2


def test_fp8_attention_settings_say_what_to_change(tiny_qwen3, triton_interpreter):
    with pytest.raises(ConfigError, match="fp8_attention='fp4' is invalid: choose off, q or qp"):
        LLM(str(tiny_qwen3), device="cpu", kv_cache_dtype="fp8", fp8_attention="fp4")
    with pytest.raises(ConfigError, match="set kv_cache_dtype='fp8' too"):
        LLM(str(tiny_qwen3), device="cpu", fp8_attention="qp")
    with pytest.raises(ConfigError, match="use block_size >= 128"):
        LLM(str(tiny_qwen3), device="cpu", kv_cache_dtype="fp8", fp8_attention="q",
            attention_backend="triton", block_size=16)
