"""Engine features on a tiny model: n > 1, dtypes, RoPE scaling, the chat CLI."""

import subprocess
import sys

import pytest
import torch

from nanovllm import LLM, SamplingParams
from tests.conftest import build_tiny_model, hf_greedy


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), device="cpu", block_size=4)


def test_n_completions(llm):
    prompt = [5, 6, 7, 8, 9]
    greedy = llm.generate([prompt], SamplingParams(n=2, temperature=0, max_tokens=6,
                                                   ignore_eos=True), use_tqdm=False)[0]
    assert len(greedy.outputs) == 2
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids
    sp = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=11, ignore_eos=True)
    a = llm.generate([prompt], sp, use_tqdm=False)[0]
    b = llm.generate([prompt, [9, 9, 9]], sp, use_tqdm=False)[0]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) == 3  # seed + index per completion
    assert [o.index for o in a.outputs] == [0, 1, 2]


def test_min_tokens_and_stop_token_ids(llm):
    prompt = [5, 6, 7, 8, 9]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)[0].token_ids
    stop_id = free[2]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8,
                                                stop_token_ids=[stop_id]), use_tqdm=False)[0]
    assert out.token_ids == free[: free.index(stop_id) + 1]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop_id
    late = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, min_tokens=6,
                                                 stop_token_ids=[stop_id]), use_tqdm=False)[0]
    assert stop_id not in late.token_ids[:6]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_float32(tiny_llama, dtype):
    llm = LLM(str(tiny_llama), device="cpu", dtype=dtype, block_size=4)
    assert llm.engine.runner.kv_cache.dtype == getattr(torch, dtype)
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


def test_cli_chat_streams_and_exits(tiny_llama):
    proc = subprocess.run(
        [sys.executable, "-m", "nanovllm", "chat", "--model", str(tiny_llama), "--device", "cpu",
         "--max-tokens", "5", "--ignore-eos"],
        input="hello there\n/reset\nagain\n/exit\n", capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("> ") >= 3


def test_kernel_warmup_leaves_the_engine_clean(tiny_llama):
    # on GPU it runs at start-up; here it runs the same steps through the torch backend
    # a long step budget with a short max_model_len: warm-up positions must stay inside
    # the RoPE table (which ends at max(max_model_len, max_position_embeddings))
    llm = LLM(str(tiny_llama), device="cpu", block_size=4, max_num_batched_tokens=2048,
              max_model_len=64)
    llm.engine.runner.warmup_kernels(llm.engine.max_model_len)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].token_ids) == 3
