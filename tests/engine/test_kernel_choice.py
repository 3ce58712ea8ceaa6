"""Kernels are chosen per engine, not per process: two engines in one process each run what
they asked for, and both agree with transformers. On the CPU the Triton kernels run in
Triton's interpreter (TRITON_INTERPRET=1, set in conftest.py)."""

import pytest

from nanovllm import LLM
from nanovllm.core.errors import ConfigError
from nanovllm.kernels import cpu_native
from tests.support import greedy, hf_greedy, make_prompts, triton_module

triton_ops = triton_module("nanovllm.kernels.triton.ops")
triton_attention = triton_module("nanovllm.kernels.triton.attention")

GREEDY = greedy(5)
# a cache of 64 blocks: the CPU default at block_size 4 is a million, seconds to set up
ENGINE = dict(device="cpu", block_size=4, num_kv_blocks=64, max_num_seqs=4,
              max_num_batched_tokens=64)


def counting(monkeypatch, module, name: str) -> list[int]:
    """Count calls of `module.name` (a function the kernels look up when they run)."""
    calls = [0]
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_two_engines_in_one_process_each_run_their_kernels(tiny_llama, hf_tiny_llama,
                                                           triton_interpreter, monkeypatch):
    # on a CUDA machine test_gpu_engine runs engines with different kernels side by side
    fused = LLM(str(tiny_llama), fused_kernels=True, attention_backend="triton", **ENGINE)
    # built after it: a global switch would win here
    plain = LLM(str(tiny_llama), native_kernels=False, **ENGINE)
    native = LLM(str(tiny_llama), **ENGINE)  # a CPU's default: kernels/cpu_native.py
    assert (fused.engine.config.kernels, fused.engine.config.attention_backend) == (
        "triton", "triton")
    assert (plain.engine.config.kernels, plain.engine.config.attention_backend) == (
        "torch", "torch")
    if not cpu_native.available():
        assert (native.engine.config.kernels, native.engine.config.attention_backend) == (
            "native", "native")
    for llm in (fused, plain, native):  # every layer holds its own engine's choice
        kernels = llm.engine.runner.kernels
        holders = [m for m in llm.engine.runner.model.modules() if hasattr(m, "kernels")]
        assert holders and all(m.kernels is kernels for m in holders)

    norms = counting(monkeypatch, triton_ops, "_launch_norm")
    attention = counting(monkeypatch, triton_attention, "launch_decode")
    prompts = make_prompts(seed=11, count=3)
    plain_out = [o.token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    assert norms == [0] and attention == [0], "the torch engine ran a Triton kernel"
    fused_out = [o.token_ids for o in fused.generate(prompts, GREEDY, use_tqdm=False)]
    assert norms[0] > 0 and attention[0] > 0, "the fused engine did not run its kernels"
    again = [o.token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    assert again == plain_out
    norms[0] = attention[0] = 0
    native_out = [o.token_ids for o in native.generate(prompts, GREEDY, use_tqdm=False)]
    assert norms == [0] and attention == [0], "the native engine ran a Triton kernel"

    expected = [hf_greedy(hf_tiny_llama, p, GREEDY.max_tokens) for p in prompts]
    assert plain_out == expected and fused_out == expected and native_out == expected


def test_triton_on_a_cpu_needs_the_interpreter(tiny_llama, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="TRITON_INTERPRET"):
        LLM(str(tiny_llama), fused_kernels=True, **ENGINE)
    with pytest.raises(ConfigError, match="attention_backend"):
        LLM(str(tiny_llama), attention_backend="triton", **ENGINE)
