"""Completions of one request: n > 1 with per-completion seeds, min_tokens, stop token ids."""

import pytest

from nanovllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), device="cpu", block_size=4, num_kv_blocks=64)


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

