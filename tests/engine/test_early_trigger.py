"""kernels/triton_pdl.py EARLY_TRIGGER (prepared, off): each Triton kernel lets the next one
launch before its own PDL wait. Only when programs start changes, never what a kernel reads:
an engine's greedy tokens are the same with it as without, through CUDA graphs, both caches.
That each kernel compiles with the trigger ahead of its wait is test_triton_ptx.py's; what it
gains is BENCHMARKS.md's."""

import pytest
import torch

from nanovllm import LLM
from tests.support import greedy, make_prompts, triton_module

pdl = triton_module("nanovllm.kernels.triton_pdl")


def test_early_trigger_is_never_taken_off_a_gpu(monkeypatch):
    monkeypatch.setattr(pdl, "EARLY_TRIGGER", True)
    assert pdl.pdl_launch(torch.zeros(4)) == {"PDL": False}


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_gpu_engine_with_early_trigger_gives_the_same_tokens(tiny_model, kv_cache_dtype,
                                                             monkeypatch):
    prompts = make_prompts(seed=7, count=8, shared_prefix=8)
    long = [p * 4 for p in prompts[:2]]  # contexts of several blocks, and KV splits
    outs = []
    for early in (False, True):
        monkeypatch.setattr(pdl, "EARLY_TRIGGER", early)
        assert pdl.pdl_launch(torch.zeros(1, device="cuda")).get("PDL") in (
            (2 if early else True), False)
        llm = LLM(str(tiny_model), device="cuda", dtype="bfloat16", max_model_len=512,
                  kv_cache_gib=1, kv_cache_dtype=kv_cache_dtype)
        outs.append([o.token_ids for o in llm.generate(prompts + long, greedy(12),
                                                       use_tqdm=False)])
        del llm
    assert outs[0] == outs[1]
