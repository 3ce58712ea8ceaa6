"""Packed GGUF weights on the CPU (weight_format "int4", and "int4-bf16", the CPU default for
GGUF files): their integers and scales are the file's (gguf.quants.dequantize gives the same
floats), the int4 / int8 kernels multiply them as float64 does within bfloat16 rounding,
every 4-bit projection really runs packed, and a model generates within a stated KL
divergence of transformers' float32 run from the same file."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from nanovllm import LLM, SamplingParams
from nanovllm.core.config import EngineConfig
from nanovllm.core.errors import ConfigError
from nanovllm.engine.resolve import resolve_config
from nanovllm.model.config import ModelConfig
from nanovllm.model.layers import embedding
from nanovllm.model.layers.embedding import HEAD_BF16_FROM_ROWS, RESCORE_TOP, LMHead
from nanovllm.model.layers.linear import BF16_FROM_ROWS, Linear, MergedLinear
from nanovllm.model.layers.quantized import (
    from_gguf_blocks,
    int4_linear,
    int8_linear,
    int8_rows,
    pack_int4,
)
from tests.gguf_support import random_k_quant
from tests.model.test_gguf_loader import write_wide_llama

BF16_EPS = 2.0**-8


def random_weight(n: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # rows of different scales and offsets, as trained weights have
    return (rng.standard_normal((n, k)) * rng.uniform(0.01, 0.2, (n, 1))
            + rng.uniform(-0.05, 0.05, (n, 1))).astype(np.float32)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
def test_blocks_hold_what_gguf_dequantizes(qtype):
    raw = quantize(random_weight(48, 256, 0), qtype)
    w = from_gguf_blocks(raw, qtype.name)
    assert w.kind == ("q8" if qtype == Q.Q8_0 else "q4")
    assert tuple(w.shape) == (48, 256)
    assert np.array_equal(w.dequantize().numpy(), dequantize(raw, qtype))
    rows = torch.tensor([5, 0, 47])
    assert np.array_equal(w.rows(rows).dequantize().numpy(), dequantize(raw, qtype)[[5, 0, 47]])


def test_q4_k_groups_hold_what_gguf_dequantizes():
    """Q4_K (llama.cpp's Q4_K_M files): 6-bit scales and mins of each group of 32 under a
    super-block's fp16 pair, mapped onto the int4 form."""
    raw = random_k_quant((48, 512), Q.Q4_K, np.random.default_rng(0))
    w = from_gguf_blocks(raw, "Q4_K")
    assert w.kind == "q4" and tuple(w.shape) == (48, 512) and w.scale.shape == (48, 16)
    np.testing.assert_allclose(w.dequantize().numpy(), dequantize(raw, Q.Q4_K),
                               rtol=1e-6, atol=1e-7)
    packed, scales_zeros = pack_int4([w])
    x = torch.randn(3, 512)
    want = x.double() @ torch.from_numpy(dequantize(raw, Q.Q4_K)).double().t()
    assert relative_error(int4_linear(x, packed, scales_zeros), want) < 4 * BF16_EPS


def test_other_types_have_no_packed_form():
    raw = quantize(random_weight(4, 64, 0), Q.Q5_0)
    assert from_gguf_blocks(raw, "Q5_0") is None


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_int4_matmul_is_the_dequantized_product(qtype, rows):
    parts = [from_gguf_blocks(quantize(random_weight(n, 192, n), qtype), qtype.name)
             for n in (64, 32, 32)]  # q | k | v, merged as MergedLinear does
    packed, scales_zeros = pack_int4(parts)
    x = torch.randn(rows, 192)
    want = x.double() @ torch.cat([p.dequantize() for p in parts]).double().t()
    got = int4_linear(x, packed, scales_zeros)
    assert got.dtype == torch.float32 and got.shape == (rows, 128)
    # x, the scales and zeros each round to bfloat16 once: a few eps of error at most
    assert relative_error(got, want) < 4 * BF16_EPS


def test_int8_rows_of_a_q8_table():
    raw = quantize(random_weight(300, 128, 1), Q.Q8_0)
    table = from_gguf_blocks(raw, "Q8_0")
    q, scales = int8_rows(table)
    w = table.dequantize().double()
    step = w.abs().amax(1, keepdim=True) / 127
    # one scale per row: each weight within half a step (the step a bfloat16 above max/127)
    assert ((q.double() * scales.double()[:, None] - w).abs() <= step * 0.5 * (1 + 2 * BF16_EPS)
            ).all()
    x = torch.randn(3, 128)
    assert relative_error(int8_linear(x, q, scales), x.double() @ w.t()) < 0.02


def test_an_8_bit_head_multiplies_many_rows_by_its_bf16_copy(monkeypatch):
    # "int4-bf16" keeps a bfloat16 copy of a Q8_0 head for steps of HEAD_BF16_FROM_ROWS rows
    # or more; either way the top logits are recomputed from the file's blocks
    table = from_gguf_blocks(quantize(random_weight(300, 128, 2), Q.Q8_0), "Q8_0")
    heads = {}
    for fmt in ("int4", "int4-bf16"):
        heads[fmt] = LMHead(300, 128)
        heads[fmt].table = table  # what weight_loader leaves
        assert heads[fmt].finish_loading(fmt).startswith("int8 (a scale per row)")
    assert heads["int4"].bf16 is None and heads["int4-bf16"].bf16.dtype == torch.bfloat16
    calls = [0]
    original = embedding.int8_linear

    def counted(*args):
        calls[0] += 1
        return original(*args)

    monkeypatch.setattr(embedding, "int8_linear", counted)
    x = torch.randn(HEAD_BF16_FROM_ROWS, 128, generator=torch.Generator().manual_seed(3))
    lean, copy = heads["int4"](x), heads["int4-bf16"](x)
    assert calls == [1], "the int8 kernel ran for the bf16 copy's step"
    want = x.double() @ table.dequantize().double().t()
    assert relative_error(copy, want) < 0.02 and relative_error(lean, want) < 0.02
    assert torch.equal(copy.argmax(-1), want.argmax(-1)), "greedy picks the exact top logit"
    # the exact likeliest lie among the copy's top RESCORE_TOP, which were recomputed
    top = want.topk(RESCORE_TOP // 2).indices
    torch.testing.assert_close(copy.gather(-1, top).double(), want.gather(-1, top),
                               rtol=1e-5, atol=1e-5)
    heads["int4-bf16"](x[:1])
    assert calls == [2], "one row is the int8 kernel's"


def test_a_merged_linear_packs_only_when_every_shard_is_4_bit():
    parts = {name: from_gguf_blocks(quantize(random_weight(32, 64, i), Q.Q4_1), "Q4_1")
             for i, name in enumerate(("gate", "up"))}
    layer = MergedLinear(64, {"gate": 32, "up": 32})
    for name, part in parts.items():
        layer.weight_loader(layer.weight, part, name)
    assert layer.finish_loading("int4") == "int4" and layer.weight.numel() == 0
    dense = MergedLinear(64, {"gate": 32, "up": 32})
    dense.weight_loader(dense.weight, parts["gate"], "gate")
    dense.weight_loader(dense.weight, parts["up"].dequantize(), "up")  # one shard came dense
    assert dense.finish_loading("int4-bf16") == "dense"
    x = torch.randn(2, 64)
    want = x.double() @ torch.cat([p.dequantize() for p in parts.values()]).double().t()
    assert torch.allclose(dense(x).double(), want, atol=1e-5)
    assert relative_error(layer(x), want) < 4 * BF16_EPS
    both = MergedLinear(64, {"gate": 32, "up": 32})
    for name, part in parts.items():
        both.weight_loader(both.weight, part, name)
    assert both.finish_loading("int4-bf16") == "int4 + bf16 copy"
    calls = []
    kernel = torch.ops.aten._weight_int4pack_mm_for_cpu
    for rows in (1, BF16_FROM_ROWS - 1, BF16_FROM_ROWS, 40):  # few rows: int4; many: bf16
        x = torch.randn(rows, 64)
        want = x.double() @ torch.cat([p.dequantize() for p in parts.values()]).double().t()
        with torch.profiler.profile() as prof:
            got = both(x)
        calls.append(any(e.name == kernel.__name__ or "int4pack" in e.name
                         for e in prof.events()))
        assert relative_error(got, want) < 4 * BF16_EPS
    assert calls == [True, True, False, False]
    unpacked = Linear(64, 32)
    unpacked.weight_loader(unpacked.weight, parts["gate"])
    assert unpacked.finish_loading("dense") == "dense (dequantized)"
    assert torch.equal(unpacked.weight, parts["gate"].dequantize())


def test_weight_format_is_resolved_per_device_and_file():
    model = ModelConfig.from_hf({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "max_position_embeddings": 128,
    })
    cpu = EngineConfig(device="cpu")
    assert resolve_config(cpu, model, quantized_file=True).weight_format == "int4-bf16"
    int4 = EngineConfig(device="cpu", weight_format="int4")
    assert resolve_config(int4, model, quantized_file=True).weight_format == "int4"
    assert resolve_config(cpu, model, quantized_file=False).weight_format == "dense"
    dense = EngineConfig(device="cpu", weight_format="dense")
    assert resolve_config(dense, model, quantized_file=True).weight_format == "dense"
    with pytest.raises(ConfigError, match="weight_format='nf4' is invalid"):
        EngineConfig(weight_format="nf4")
    if not torch.cuda.is_available():
        return
    gpu = EngineConfig(device="cuda")
    assert resolve_config(gpu, model, quantized_file=True).weight_format == "dense"
    with pytest.raises(ConfigError, match="CPU only"):
        resolve_config(EngineConfig(device="cuda", weight_format="int4"), model, True)


def full_logprobs(steps: list[dict[int, float]], vocab: int) -> torch.Tensor:
    out = torch.full((len(steps), vocab), float("nan"), dtype=torch.float64)
    for i, step in enumerate(steps):
        out[i, list(step)] = torch.tensor(list(step.values()), dtype=torch.float64)
    return out


# Mean KL(transformers float32 || packed) per generated token, in nats: measured 1.3e-3
# (Q4_0), 1.6e-3 (Q4_1) and 1.8e-4 (mixed) on this random model, whose activations and
# scales round to bfloat16 in every projection; a nibble order swapped gives 5.5.
MAX_MEAN_KL = 5e-3


@pytest.mark.parametrize("qtypes, weight_format", [
    ([Q.Q4_0], "int4-bf16"), ([Q.Q4_1], "int4"), ([Q.Q4_K], "int4"),
    ([Q.Q4_1, Q.Q8_0, Q.Q4_0], "int4-bf16"),
], ids=["Q4_0-int4-bf16", "Q4_1-int4", "Q4_K-int4", "mixed-int4-bf16"])
def test_packed_model_generates_close_to_transformers(wide_llama, tmp_path, qtypes,
                                                      weight_format):
    """Each projection runs packed (checked), and the next-token distribution at each greedy
    step is within MAX_MEAN_KL of transformers' float32 run from the same file."""
    from transformers import AutoModelForCausalLM

    path = write_wide_llama(tmp_path / "q.gguf", wide_llama, qtypes)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="q.gguf",
                                              dtype=torch.float32).eval()
    llm = LLM(path, device="cpu", block_size=4, num_kv_blocks=32, weight_format=weight_format)
    assert llm.engine.config.weight_format == weight_format
    layers = llm.engine.runner.model.model.layers
    projections = [m for layer in layers for m in layer.modules() if isinstance(m, Linear)]
    want_packed = [m for m in projections]
    if Q.Q8_0 in qtypes:  # an 8-bit projection has no packed form: dense
        want_packed = [m for m in projections if m.packed is not None]
        assert 0 < len(want_packed) < len(projections)
    assert all(m.packed is not None for m in want_packed)
    vocab = llm.engine.model_config.vocab_size
    prompts = [[5, 6, 7, 8, 9, 10, 11], [300, 200, 100], list(range(20, 50))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=vocab)
    kls = []
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out.token_ids])).logits[0].double()
        ref = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
        ours = full_logprobs(out.outputs[0].logprobs, vocab)
        kls.append((ref.exp() * (ref - ours)).sum(-1))
    kls = torch.cat(kls)
    assert kls.mean() < MAX_MEAN_KL, kls
