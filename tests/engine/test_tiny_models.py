"""Greedy outputs of tiny random Llama / Qwen2 / Qwen3 models equal transformers', whatever
the batch, chunk size, prefix-cache hits, preemption or scheduling policy; RoPE scaling and
half precision."""


import pytest
import torch

from nanovllm import LLM, SamplingParams
from tests.support import build_tiny_model, hf_greedy, make_prompts

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def reference(tiny_model):
    """transformers' greedy continuation of each prompt, computed once per prompt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    cache: dict[tuple[int, ...], list[int]] = {}

    def ref(prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in cache:
            cache[key] = hf_greedy(model, prompt, MAX_TOKENS)
        return cache[key]

    return ref


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

VARIANTS = {
    "default": dict(),
    "chunked": dict(max_num_batched_tokens=8, max_num_seqs=4, block_size=4),
    "preempt": dict(num_kv_blocks=24, block_size=4, max_model_len=96, max_num_seqs=8),
    "prefill_first": dict(
        scheduling_policy="prefill_first", max_num_batched_tokens=32, max_num_seqs=4, block_size=8
    ),
    "prefill_first_preempt": dict(
        scheduling_policy="prefill_first",
        num_kv_blocks=24,
        block_size=4,
        max_model_len=96,
        max_num_seqs=8,
    ),
    "no_prefix_cache": dict(enable_prefix_caching=False, block_size=4),
    # overlap runs the engine's deferred-token path even on CPU (launch is synchronous there)
    "overlap": dict(overlap=True, max_num_batched_tokens=8, max_num_seqs=4, block_size=4),
    "overlap_preempt": dict(overlap=True, num_kv_blocks=24, block_size=4, max_model_len=96,
                            max_num_seqs=8),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_matches_transformers(tiny_model, reference, variant):
    llm = LLM(str(tiny_model), device="cpu", **VARIANTS[variant])
    prompts = make_prompts(seed=1, count=8, shared_prefix=12)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference(prompt)
        assert out.finish_reason == "length"
        assert out.num_prompt_tokens == len(prompt)
    sched = llm.engine.scheduler
    if variant.endswith("preempt"):
        assert sched.num_preemptions > 0, "the tiny KV budget should have forced preemption"
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_prefix_cache_reuses_blocks(tiny_model, reference):
    llm = LLM(str(tiny_model), device="cpu", block_size=4)
    system = make_prompts(seed=7, count=1, shared_prefix=0)[0][:1] + list(range(10, 50))
    first = [system + [60, 61, 62]]
    rest = [system + [70 + i, 80 + i] for i in range(4)]
    out1 = llm.generate(first, GREEDY, use_tqdm=False)
    hits_before = llm.engine.scheduler.prefix_hits
    out2 = llm.generate(rest, GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.prefix_hits - hits_before >= 4 * 40  # 10 full blocks each
    assert all(o.num_cached_tokens >= 40 for o in out2)
    for prompt, out in zip(first + rest, out1 + out2):
        assert out.token_ids == reference(prompt)


def test_batch_of_one_equals_batch_of_many(tiny_model):
    llm = LLM(str(tiny_model), device="cpu", block_size=8)
    prompts = make_prompts(seed=3, count=6)
    together = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    alone = [llm.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in prompts]
    assert together == alone


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_float32(tiny_llama, dtype):
    llm = LLM(str(tiny_llama), device="cpu", dtype=dtype, block_size=4)
    assert llm.engine.runner.kv_cache.tensor.dtype == getattr(torch, dtype)
    out = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(temperature=0, max_tokens=4,
                                                         ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 4


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
])
def test_rope_scaling_matches_transformers(tmp_path, scaling):
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(tmp_path, "llama", rope_scaling=scaling)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = [(i * 37) % 390 + 3 for i in range(100)]  # past the original 64 positions
    ours = LLM(str(path), device="cpu", block_size=8).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert ours[0].token_ids == hf_greedy(hf, prompt, 5)
