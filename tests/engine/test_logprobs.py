"""Every generated token's logprobs (the sampled token's and the top N) equal transformers'
log_softmax over the same context, request by request, whatever the batch, chunked prefill,
preemption or overlap: a request is never shown another row's distribution, nor its own
shifted by a token. Offline, streamed whole and streamed as deltas."""

import functools

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.engine.llm_engine import LLMEngine
from tests.support import make_prompts

# Both sides run float32 on the CPU; only reduction orders differ (paged vs dense attention,
# chunks), and the worst gap measured is 2.4e-6. Another request's row, or the neighbouring
# token's, is off by far more than 1e-4 (the closest two of a row's top 6 differ by 5e-4).
TOL = 1e-4
MAX_TOKENS = 8

# One batch mixes what logprob_dicts must keep apart: greedy and seeded rows, the one-pass
# and filtered samplers, top N of different sizes, 0 (the sampled token only), rows that ask
# for nothing, and n=2. ignore_eos keeps every row MAX_TOKENS long.
PARAMS = [
    SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **kw)
    for kw in (
        dict(temperature=0, logprobs=3),
        dict(temperature=1.0, seed=11, logprobs=5),
        dict(temperature=0, logprobs=0),
        dict(temperature=1.0, seed=12),
        dict(temperature=0.8, top_k=20, top_p=0.9, seed=13, logprobs=2),
        dict(temperature=1.0, seed=14, n=2, logprobs=4),
    )
]

VARIANTS = {
    "plain": dict(),
    "chunked": dict(max_num_batched_tokens=8, max_num_seqs=4, block_size=4),
    # admission_headroom=0: the default would queue prompts rather than preempt
    "preempt": dict(num_kv_blocks=16, block_size=4, max_model_len=64, admission_headroom=0),
    "swap_preempt": dict(num_kv_blocks=16, block_size=4, max_model_len=64,
                         admission_headroom=0, swap_space=0.01, preemption_mode="swap"),
    # overlap runs the deferred-token path even on the CPU (launch is synchronous there)
    "overlap": dict(overlap=True, max_num_batched_tokens=8, max_num_seqs=4, block_size=4),
    "overlap_preempt": dict(overlap=True, num_kv_blocks=16, block_size=4, max_model_len=64,
                            admission_headroom=0),
}


@functools.cache
def _hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_logprobs(path, prompt: list[int], output: list[int]) -> torch.Tensor:
    """transformers' log_softmax for each token of `output` [len(output), vocab]: one full
    forward pass over prompt + output, no cache."""
    with torch.no_grad():
        logits = _hf_model(str(path))(torch.tensor([prompt + output])).logits[0].float()
    return torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]


def assert_logprobs_match(path, prompt, token_ids, logprobs, top_n, what=""):
    """`logprobs[j]` is {sampled id: logprob} plus the top `top_n` ids of transformers'
    distribution for token j, each with transformers' value; None when `top_n` is None."""
    if top_n is None:
        assert not logprobs, f"{what}: logprobs not asked for, got {logprobs}"
        return
    assert len(logprobs) == len(token_ids), f"{what}: one entry per token"
    ref = hf_logprobs(path, prompt, token_ids)
    for j, (token, entry) in enumerate(zip(token_ids, logprobs)):
        top = ref[j].topk(top_n).indices.tolist() if top_n else []
        assert set(entry) == {token, *top}, f"{what}: token {j}: ids {entry} vs top {top}"
        for t, lp in entry.items():
            assert lp == pytest.approx(ref[j, t].item(), abs=TOL), f"{what}: token {j}, id {t}"


def _check_outputs(path, prompts, outs):
    for i, (prompt, params, out) in enumerate(zip(prompts, PARAMS, outs)):
        assert len(out.outputs) == params.n
        for o in out.outputs:
            assert len(o.token_ids) == MAX_TOKENS
            what = f"request {i} completion {o.index}"
            assert_logprobs_match(path, prompt, o.token_ids, o.logprobs, params.logprobs, what)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_offline_logprobs_match_transformers(tiny_llama, variant):
    """LLM.generate's logprobs per token, for a mixed batch, under each engine setting."""
    llm = LLM(str(tiny_llama), device="cpu", **{"num_kv_blocks": 64, **VARIANTS[variant]})
    prompts = make_prompts(seed=5, count=len(PARAMS))
    _check_outputs(tiny_llama, prompts, llm.generate(prompts, PARAMS, use_tqdm=False))
    if "preempt" in variant:
        assert llm.engine.scheduler.num_preemptions > 0, "the tiny KV cache should preempt"


def test_logprobs_match_transformers_every_arch(tiny_model):
    """Llama, Qwen2 (tied embeddings) and Qwen3 (q/k norm): the whole distribution, not only
    its argmax, is transformers'."""
    llm = LLM(str(tiny_model), device="cpu", num_kv_blocks=64, block_size=4)
    prompts = make_prompts(seed=6, count=len(PARAMS))
    _check_outputs(tiny_model, prompts, llm.generate(prompts, PARAMS, use_tqdm=False))


def test_streamed_logprobs_match_transformers(tiny_llama):
    """LLMEngine streaming, whole and as deltas, with overlap, chunked prefill and
    preemption: the logprobs pieces add up to transformers' for each token, in order."""
    engine = LLMEngine(str(tiny_llama), device="cpu", overlap=True, block_size=4,
                       num_kv_blocks=16, max_model_len=64, max_num_batched_tokens=16,
                       admission_headroom=0,
                       max_num_seqs=8)
    prompts = make_prompts(seed=7, count=len(PARAMS))
    for i, (prompt, params) in enumerate(zip(prompts, PARAMS)):
        engine.add_request(prompt, params, f"delta{i}", stream=True, delta=True)
        engine.add_request(prompt, params, f"whole{i}", stream=True)
    seen: dict[tuple[str, int], tuple[list[int], list]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for o in out.outputs:
                ids, lps = seen.setdefault((out.request_id, o.index), ([], []))
                if out.request_id.startswith("delta"):
                    ids += o.token_ids
                    lps += o.logprobs or []
                else:  # cumulative: the latest output holds everything
                    ids[:], lps[:] = o.token_ids, o.logprobs or []
    assert engine.scheduler.num_preemptions > 0, "the tiny KV cache should preempt"
    for i, (prompt, params) in enumerate(zip(prompts, PARAMS)):
        for kind in ("delta", "whole"):
            for index in range(params.n):
                ids, lps = seen[(f"{kind}{i}", index)]
                assert len(ids) == MAX_TOKENS
                assert_logprobs_match(tiny_llama, prompt, ids, lps, params.logprobs,
                                      f"{kind}{i} completion {index}")
