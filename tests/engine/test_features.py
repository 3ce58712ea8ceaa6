"""Engine features on a tiny model: n > 1, dtypes, RoPE scaling, kernel warm-up, streaming."""

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.worker.warmup import warm_up_kernels
from tests.support import build_tiny_model, hf_greedy


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


def test_kernel_warmup_leaves_the_engine_clean(tiny_llama):
    # on GPU it runs at start-up; here it runs the same steps through the torch backend
    # a long step budget with a short max_model_len: warm-up positions must stay inside
    # the RoPE table
    llm = LLM(str(tiny_llama), device="cpu", block_size=4, max_num_batched_tokens=2048,
              max_model_len=64)
    warm_up_kernels(llm.engine.runner)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].token_ids) == 3


@pytest.mark.parametrize("extra", [
    dict(overlap=False),
    dict(overlap=True),
    # chunked prefill, and a KV cache too small for every running row: preemption while
    # streaming recomputes a sequence, and must neither repeat nor lose what was sent
    dict(overlap=True, max_num_batched_tokens=6, num_kv_blocks=9),
], ids=["plain", "overlap", "overlap+preempt"])
def test_streamed_outputs_show_only_tokens_on_the_host(tiny_llama, extra):
    """Streaming, cumulative and delta, against the offline result of the same requests:
    with overlap a step's sampled token is still a placeholder when the step reports, and
    outputs must not show it. Delta outputs add up to the whole completion, with one
    logprobs entry per token, and never show a stop string's prefix that is later cut."""
    from nanovllm.engine.llm_engine import LLMEngine

    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    args = dict(n=2, temperature=0.8, seed=4, max_tokens=10, ignore_eos=True, logprobs=2)
    sp = SamplingParams(**args)
    kw = dict(device="cpu", block_size=4, max_num_seqs=3, **extra)
    offline = LLM(str(tiny_llama), **kw).generate(prompts, sp, use_tqdm=False)
    stop = offline[0].outputs[1].text[3:6]
    stopped = LLM(str(tiny_llama), **kw).generate(
        [prompts[0]], SamplingParams(**args, stop=[stop]), use_tqdm=False)[0]
    engine = LLMEngine(str(tiny_llama), **kw)
    for i, p in enumerate(prompts):
        engine.add_request(p, sp, f"cum{i}", stream=True)
        engine.add_request(p, sp, f"delta{i}", stream=True, delta=True)
    engine.add_request(prompts[0], SamplingParams(**args, stop=[stop]), "stop",
                       stream=True, delta=True)
    engine.add_request(prompts[1], sp, "ids", stream=True, delta=True, detokenize=False)
    seen: dict[tuple[str, int], dict] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for o in out.outputs:
                assert -1 not in o.token_ids
                s = seen.setdefault((out.request_id, o.index), {"ids": [], "text": "", "lps": 0})
                if out.request_id.startswith("cum"):
                    assert o.token_ids[: len(s["ids"])] == s["ids"]  # grows, never rewritten
                    s["ids"], s["text"], s["lps"] = o.token_ids, o.text, len(o.logprobs)
                else:
                    s["ids"] = s["ids"] + o.token_ids
                    s["text"] += o.text
                    s["lps"] += len(o.logprobs)
                    assert len(o.logprobs) == len(o.token_ids)
                    if out.request_id == "stop":  # what was shown stays in the final text
                        assert stopped.outputs[o.index].text.startswith(s["text"])
                s["reason"] = o.finish_reason
    for i, ref in enumerate(offline):
        for o in ref.outputs:
            for kind in ("cum", "delta"):
                s = seen[(f"{kind}{i}", o.index)]
                assert (s["ids"], s["text"], s["reason"]) == (o.token_ids, o.text, "length")
                assert s["lps"] == len(o.token_ids)
    for o in stopped.outputs:
        s = seen[("stop", o.index)]
        assert (s["ids"], s["text"], s["reason"]) == (o.token_ids, o.text, o.finish_reason)
    for o in offline[1].outputs:
        s = seen[("ids", o.index)]
        assert s["ids"] == o.token_ids and s["text"] == ""
    if "num_kv_blocks" in extra:
        assert engine.scheduler.num_preemptions > 0
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
