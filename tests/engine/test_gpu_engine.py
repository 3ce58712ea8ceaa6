"""The GPU path (Triton attention, CUDA graphs, overlap) against transformers and the CPU
engine, on the tiny models."""

import gc

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.kernels import cpu_native
from tests.support import greedy, make_prompts

pytestmark = pytest.mark.gpu

GREEDY = greedy(12)

GPU_VARIANTS = {
    "graphs+overlap": dict(gpu_memory_utilization=0.2),  # KV sized by profiling
    "eager": dict(enforce_eager=True, kv_cache_gib=1),
    "no_overlap": dict(overlap=False, kv_cache_gib=1),
    "chunked+preempt": dict(max_num_batched_tokens=16, max_num_seqs=8, num_kv_blocks=70,
                            block_size=4),
    "block64": dict(block_size=64, kv_cache_gib=1),
}


@pytest.fixture(autouse=True)
def _free_gpu():
    yield
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("variant", sorted(GPU_VARIANTS))
def test_gpu_greedy_matches_transformers_and_cpu(tiny_model, greedy_reference, variant):
    prompts = make_prompts(seed=5, count=12, shared_prefix=8)
    gpu = LLM(str(tiny_model), device="cuda", dtype="float32", max_model_len=256,
              **GPU_VARIANTS[variant])
    outs = [o.token_ids for o in gpu.generate(prompts, GREEDY, use_tqdm=False)]
    cpu = LLM(str(tiny_model), device="cpu", block_size=4)
    assert outs == [o.token_ids for o in cpu.generate(prompts, GREEDY, use_tqdm=False)]
    assert outs == [greedy_reference(p, GREEDY.max_tokens) for p in prompts]
    bm = gpu.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_gpu_bf16_sampling_and_seeds(tiny_model):
    llm = LLM(str(tiny_model), device="cuda", dtype="bfloat16", max_model_len=256,
              kv_cache_gib=1)
    prompts = make_prompts(seed=9, count=6)
    sp = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=3, max_tokens=16,
                        ignore_eos=True)
    a = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    b = [o.token_ids for o in llm.generate(prompts[::-1], sp, use_tqdm=False)][::-1]
    assert a == b  # seeded rows do not depend on batch order
    pen = greedy(16, repetition_penalty=1.3, presence_penalty=0.5)
    assert all(len(o.token_ids) == 16 for o in llm.generate(prompts, pen, use_tqdm=False))


def test_gpu_streamed_deltas_add_up_to_the_offline_result(tiny_model):
    """With overlap (the GPU default) a step reports while its token is still on the device:
    streamed outputs must show only tokens on the host, and add up to generate()'s."""

    prompts = make_prompts(seed=7, count=6)
    sp = SamplingParams(temperature=0.7, seed=2, max_tokens=12, ignore_eos=True, logprobs=1)
    llm = LLM(str(tiny_model), device="cuda", dtype="float32", max_model_len=256,
              kv_cache_gib=1)
    offline = llm.generate(prompts, sp, use_tqdm=False)
    engine = llm.engine
    assert engine.overlap
    for i, p in enumerate(prompts):
        engine.add_request(p, sp, f"d{i}", stream=True, delta=True, detokenize=i % 2 == 0)
    ids: dict[str, list[int]] = {f"d{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for o in out.outputs:
                assert -1 not in o.token_ids and len(o.logprobs) == len(o.token_ids)
                ids[out.request_id] += o.token_ids
    assert [ids[f"d{i}"] for i in range(len(prompts))] == [o.token_ids for o in offline]


def test_engines_on_one_gpu_and_the_cpu_each_get_their_settings(tiny_model, greedy_reference):
    """Graphs + fused kernels, eager + torch ops, and the CPU, in one process at once."""
    fast = LLM(str(tiny_model), device="cuda", dtype="float32", max_model_len=256,
               kv_cache_gib=1)
    eager = LLM(str(tiny_model), device="cuda", dtype="float32", max_model_len=256,
                kv_cache_gib=1, enforce_eager=True, fused_kernels=False)
    cpu = LLM(str(tiny_model), device="cpu", block_size=4)
    assert fast.engine.runner.graphs is not None and fast.engine.config.kernels == "triton"
    assert eager.engine.runner.graphs is None and eager.engine.config.kernels == "torch"
    assert eager.engine.config.attention_backend == "triton"
    # the CPU's own: the C kernels where its compiler builds them (kernels/cpu_native.py)
    cpu_kernels = "torch" if cpu_native.available() else "native"
    assert cpu.engine.config.kernels == cpu.engine.config.attention_backend == cpu_kernels
    prompts = make_prompts(seed=13, count=6)
    expected = [greedy_reference(p, GREEDY.max_tokens) for p in prompts]
    for llm in (fast, eager, cpu, fast):
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
