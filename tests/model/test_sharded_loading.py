"""Each tensor-parallel rank loads only its shard: from safetensors (a slice read from the
file) and from GGUF (dense, and 4/8-bit kept quantized), every parameter of rank r equals
its slice of the one-device model, and no rank holds the whole model."""

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from nanovllm.kernels import select_kernels
from nanovllm.model.config import ModelConfig
from nanovllm.model.layers.embedding import LMHead, VocabEmbedding
from nanovllm.model.layers.linear import Linear, MergedLinear
from nanovllm.model.loader.source import open_model
from nanovllm.model.loader.weights import load_weights
from nanovllm.model.models.registry import build_model
from nanovllm.model.parallel import TensorParallel
from tests.gguf_support import byte_level_tokenizer
from tests.model.test_gguf_loader import write_model_gguf
from tests.support import build_tiny_model


def load(path, tp: TensorParallel, weight_format: str = "dense", reads: list | None = None):
    source = open_model(path)
    cfg = ModelConfig.from_hf(source.hf_config)
    model = build_model(cfg, cfg.max_position_embeddings, select_kernels("torch", "torch"), tp)
    tensors = source.tensors(quantized=weight_format != "dense")
    if reads is not None:
        tensors = _recorded(tensors, reads)
    load_weights(model, tensors, weight_format)
    return model


def _recorded(tensors, reads):
    for name, weight in tensors:
        read = weight.read

        def spy(dim=None, start=0, length=None, read=read, name=name):
            reads.append((name, dim))
            return read(dim, start, length)

        weight.read = spy
        yield name, weight


def expected_part(module, name: str, full: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Rank tp.rank's part of the one-device parameter `full`."""
    if isinstance(module, (VocabEmbedding, LMHead)):
        start, rows = tp.vocab_rows(full.shape[0])
        part = torch.zeros(rows, full.shape[1])
        n = min(rows, full.shape[0] - start)
        part[:n] = full[start : start + n]
        return part
    if isinstance(module, MergedLinear):
        full_sizes, starts = module.full_sizes, {}
        at = 0
        for shard, size in full_sizes.items():
            starts[shard] = at
            at += size
        return torch.cat([full.narrow(0, starts[s] + src, n)
                          for s, (src, n) in module.sources.items()])
    if isinstance(module, Linear) and module.part is not None:
        dim, start, length = module.part
        if name.endswith("bias") and dim == 1:
            return full
        return full.narrow(dim, start, length)
    return full


def assert_shards(path, size: int, weight_format: str = "dense") -> int:
    """Returns how many packed 4-bit shards were compared."""
    compared = 0
    whole = load(path, TensorParallel())
    full = dict(whole.named_parameters())
    for rank in range(size):
        tp = TensorParallel(rank, size)
        reads: list = []
        model = load(path, tp, reads=reads)
        modules = dict(model.named_modules())
        held = 0
        for name, param in model.named_parameters():
            module = modules[name.rsplit(".", 1)[0]]
            expected = expected_part(module, name, full[name], tp)
            assert torch.equal(param, expected), (rank, name)
            held += param.numel()
        assert held < 0.6 * sum(p.numel() for p in full.values())
        sharded = [n for n, dim in reads if "proj" in n or "embed" in n or "lm_head" in n]
        whole_reads = [n for n, dim in reads if dim is None and n in sharded]
        assert sharded and not whole_reads, whole_reads
        if weight_format != "dense":  # packed shards multiply like the dense shards
            packed = load(path, tp, weight_format)
            x = torch.randn(3, packed.config.hidden_size)
            for name, module in packed.named_modules():
                if isinstance(module, MergedLinear) and module.packed is not None:
                    dense = modules[name]
                    got, want = module(x), dense(x)
                    assert (got - want).abs().max() < 0.05 * want.abs().max(), name
                    compared += 1
    return compared


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_safetensors_shards(tmp_path, arch):
    path = build_tiny_model(tmp_path / arch, arch, vocab_size=511, num_key_value_heads=1)
    assert_shards(path, 2)


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0, Q.Q4_0, Q.Q4_K], ids=lambda q: q.name)
def test_gguf_shards(wide_llama, tmp_path, qtype):
    cfg, state_dict = wide_llama
    path = write_model_gguf(tmp_path / f"{qtype.name}.gguf", cfg, state_dict,
                            byte_level_tokenizer(), qtype)
    compared = assert_shards(path, 2, "int4" if qtype != Q.F32 else "dense")
    assert compared == (8 if qtype in (Q.Q4_0, Q.Q4_K) else 0)  # qkv, gate_up: 2 layers, 2 ranks
