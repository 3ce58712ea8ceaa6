"""GGUF loading: our tensor table is GGUFReader's, every weight type llama.cpp writes loads as
the gguf package dequantizes it, and models written as llama.cpp's converter writes them
generate what transformers generates from the same weights."""

import itertools
import json

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from nanovllm import LLM, SamplingParams
from nanovllm.model.loader.gguf_file import GGUFFile, read_gguf
from nanovllm.model.loader.gguf_loader import gguf_to_hf_config, iter_gguf
from nanovllm.model.loader.source import default_model_path
from tests.gguf_support import (
    byte_level_tokenizer,
    gguf_name,
    model_tensors,
    permute_rope,
    write_gguf,
)
from tests.support import hf_greedy

# llama.cpp's weight types; gguf.quants quantizes all but the K-quants (tests/gguf_support.py
# writes random K-quant blocks instead)
TYPES = [
    Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.Q4_0, Q.Q4_1,
    Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
]


def file_offset(data: np.ndarray) -> int:
    """Where a memory-mapped tensor's bytes start in its file (both readers map it whole)."""
    root = data
    while isinstance(root.base, np.ndarray):
        root = root.base
    return data.ctypes.data - root.ctypes.data


def assert_same_table(ours: GGUFFile, reader: gguf.GGUFReader) -> None:
    assert [t.name for t in ours.tensors] == [t.name for t in reader.tensors]
    for a, b in zip(ours.tensors, reader.tensors, strict=True):
        assert a.qtype == b.tensor_type, a.name
        assert a.shape == tuple(reversed(b.shape.tolist())), a.name  # GGUF lists dims inner first
        assert (file_offset(a.data), a.data.nbytes) == (b.data_offset, b.n_bytes), a.name
        assert (a.data.dtype, a.data.shape) == (b.data.dtype, b.data.shape), a.name
        assert np.array_equal(a.data, b.data), a.name


def test_tensor_table_matches_gguf_reader():
    """Every one of the default model's 272 tensors: the name, type, shape, file offset, size
    and bytes GGUFReader reads; its first three (Q8_0, F32, Q4_1: one of each type in the
    file) load as gguf.quants.dequantize gives them."""
    path = default_model_path()
    ours = read_gguf(path)
    reader = gguf.GGUFReader(str(path))
    assert len(ours.tensors) == 272
    assert_same_table(ours, reader)
    first = list(itertools.islice(iter_gguf(ours, gguf_to_hf_config(ours)), 3))
    assert [name for name, _ in first] == [
        "model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
        "model.layers.0.mlp.down_proj.weight",
    ]
    for (_, w), t in zip(first, reader.tensors):
        assert np.array_equal(w.numpy(), dequantize(t.data, t.tensor_type)), t.name


def write_model_gguf(
    path, cfg: dict, state_dict: dict, tokenizer_json: str, qtypes=Q.F32, alignment=None
) -> str:
    return write_gguf(
        path, cfg["model_type"], tokenizer_json=tokenizer_json, vocab_size=cfg["vocab_size"],
        pre="gpt2", special={"eos": "<|im_end|>"}, config=cfg,
        tensors=model_tensors(state_dict, cfg, qtypes), alignment=alignment,
    )


def test_gguf_matches_transformers(tiny_model, tmp_path):
    """Each family (Llama's permuted q/k, Qwen2's biases and tied embeddings, Qwen3's q/k norms)
    written to F32 GGUF generates exactly what transformers generates from the original."""
    from transformers import AutoModelForCausalLM

    cfg = json.loads((tiny_model / "config.json").read_text())
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    path = write_model_gguf(tmp_path / "tiny.gguf", cfg, hf.state_dict(),
                            (tiny_model / "tokenizer.json").read_text())
    llm = LLM(path, device="cpu", block_size=4, num_kv_blocks=16, weight_format="dense")
    prompts = [[5, 6, 7, 8, 9, 10, 11], [300, 200, 100]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 6)
    assert llm.engine.eos_token_ids == {2}


def write_wide_llama(path, wide_llama, qtypes, alignment=None) -> str:
    cfg, state_dict = wide_llama
    return write_model_gguf(path, cfg, state_dict, byte_level_tokenizer(), qtypes, alignment)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_each_type_loads_as_gguf_dequantizes(wide_llama, tmp_path, qtype):
    """A file whose matrices are all `qtype`: its table is GGUFReader's, and our loader yields
    every tensor of the checkpoint, under its Hugging Face name, in its shape, equal to
    GGUFReader + gguf.quants.dequantize (exactly: both are that float32 arithmetic, ours
    only reshapes and un-permutes)."""
    cfg, state_dict = wide_llama
    path = write_wide_llama(tmp_path / f"{qtype.name}.gguf", wide_llama, qtype)
    file, reader = read_gguf(path), gguf.GGUFReader(path)
    assert_same_table(file, reader)
    assert {t.qtype for t in file.tensors} == {Q.F32, qtype}
    ours = dict(iter_gguf(file, gguf_to_hf_config(file)))
    assert sorted(ours) == sorted(state_dict)
    expected = {t.name: dequantize(t.data, t.tensor_type) for t in reader.tensors}
    for name, w in ours.items():
        assert w.dtype == torch.float32 and w.shape == state_dict[name].shape, name
        got = w.numpy()
        if name.endswith("q_proj.weight"):  # back into the file's order, as the converter did
            got = permute_rope(got, cfg["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            got = permute_rope(got, cfg["num_key_value_heads"])
        assert np.array_equal(got, expected[gguf_name(name)]), name


def test_mixed_types_match_transformers(wide_llama, tmp_path):
    """A file whose matrices take every type in turn (as llama.cpp's mixed presets mix them),
    its data aligned to 256 bytes, not 32: its table is GGUFReader's, and it generates what
    transformers generates from the same file, with the same top logprobs."""
    from transformers import AutoModelForCausalLM

    path = write_wide_llama(tmp_path / "mixed.gguf", wide_llama, TYPES, alignment=256)
    file = read_gguf(path)
    assert {t.qtype for t in file.tensors} == set(TYPES)
    assert_same_table(file, gguf.GGUFReader(path))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="mixed.gguf",
                                              dtype=torch.float32).eval()
    llm = LLM(path, device="cpu", block_size=4, num_kv_blocks=16, weight_format="dense")
    prompts = [[5, 6, 7, 8, 9, 10, 11], [300, 200, 100]]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        ids = list(prompt)
        for token, logprobs in zip(out.token_ids, out.outputs[0].logprobs, strict=True):
            with torch.no_grad():
                ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1], -1)
            top = torch.topk(ref, 3)
            assert token == int(top.indices[0])
            # same float32 weights; only the order of sums differs (~1e-5 here)
            for t, lp in zip(top.indices.tolist(), top.values.tolist()):
                assert logprobs[t] == pytest.approx(lp, abs=1e-3)
            ids.append(token)


def test_corrupt_gguf_is_a_clear_error(tmp_path, wide_llama):
    """A broken header, or a file cut inside its tensor data (an interrupted download), is a
    ModelLoadError that says so, not numpy's reshape error."""
    from nanovllm import ModelLoadError

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 10)
    with pytest.raises(ModelLoadError, match="cannot read GGUF"):
        LLM(str(bad))
    cut = tmp_path / "cut.gguf"
    whole = open(write_wide_llama(tmp_path / "whole.gguf", wide_llama, Q.Q8_0), "rb").read()
    cut.write_bytes(whole[:-1000])
    with pytest.raises(ModelLoadError, match="ends inside tensor 'output.weight': it is truncated"):
        LLM(str(cut))
