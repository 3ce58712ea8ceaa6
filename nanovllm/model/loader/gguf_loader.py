"""GGUF files: the model config from metadata, weights dequantized with the `gguf` package."""

from collections.abc import Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from nanovllm.core.errors import ModelLoadError
from nanovllm.model.layers.quantized import QuantizedWeight, from_gguf_blocks, read_part
from nanovllm.model.loader.gguf_file import GGUFFile, GGUFTensor

GGUF_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def gguf_to_hf_config(file: GGUFFile) -> dict:
    meta = file.metadata
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHS:
        raise ModelLoadError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(GGUF_ARCHS)}"
        )

    def get(key: str, default=None):
        return meta.get(f"{arch}.{key}", default)

    heads = get("attention.head_count")
    hidden = get("embedding_length")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    names = {t.name for t in file.tensors}
    scaling = None
    if get("rope.scaling.type") in ("linear",):
        scaling = {"rope_type": "linear", "factor": get("rope.scaling.factor")}
    elif get("rope.scaling.type") not in (None, "none"):
        raise ModelLoadError(f"GGUF rope scaling {get('rope.scaling.type')!r} is not supported")
    return {
        "architectures": [GGUF_ARCHS[arch]],
        "vocab_size": get("vocab_size") or len(tokens),
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length", hidden // heads),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": get("rope.freq_base", 10000.0),
        "rope_scaling": scaling,
        "max_position_embeddings": get("context_length", 4096),
        "tie_word_embeddings": "output.weight" not in names,
        "dtype": "float32",
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    # llama.cpp interleaves the two RoPE halves of each head for Llama; undo it
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFWeight:
    """One tensor of the file under its Hugging Face name, read when a layer asks for it, and
    only the slice it asks for (a tensor-parallel rank's rows come from the memory map
    alone; a slice of columns is cut once the rows are read)."""

    def __init__(self, tensor: GGUFTensor, quantized: bool, heads: int | None) -> None:
        self.tensor, self.quantized, self.heads = tensor, quantized, heads
        self.shape = tensor.shape

    def read(self, dim: int | None = None, start: int = 0, length: int | None = None):
        t = self.tensor
        data = t.data[start : start + length] if dim == 0 else t.data
        # Llama's q/k rows are permuted within each head: a slice of whole heads un-permutes
        # on its own
        heads = self.heads and self.heads * data.shape[0] // t.shape[0]
        w = self._convert(data, heads)
        return read_part(w, 1, start, length) if dim == 1 else w

    def _convert(self, data: np.ndarray, heads: int | None):
        q = (from_gguf_blocks(data, self.tensor.qtype.name)
             if self.quantized and data.ndim == 2 else None)
        if q is not None:
            if heads:
                q = q.rows(torch.from_numpy(_unpermute(np.arange(q.shape[0]), heads)))
            return q
        qtype = self.tensor.qtype
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            w = data.astype(np.float32)
        else:
            w = dequantize(data, qtype).astype(np.float32, copy=False)
        if heads:
            w = _unpermute(w, heads)
        return torch.from_numpy(np.ascontiguousarray(w))


def gguf_weights(
    file: GGUFFile, cfg: dict, quantized: bool = False
) -> Iterator[tuple[str, GGUFWeight]]:
    """The file's tensors under Hugging Face names, as GGUFWeight (read on demand): dense
    float32; with `quantized`, Q4_0, Q4_1, Q4_K and Q8_0 weights as QuantizedWeight
    (integers and scales as stored)."""
    llama = cfg["architectures"][0] == "LlamaForCausalLM"
    for t in file.tensors:
        base, _, suffix = t.name.rpartition(".")
        parts = base.split(".")
        if parts[0] == "blk" and len(parts) == 3 and parts[2] in LAYER_NAMES:
            name = f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{suffix}"
        elif base in GLOBAL_NAMES:
            name = f"{GLOBAL_NAMES[base]}.{suffix}"
        else:
            continue
        heads = None
        if llama and parts[-1] in ("attn_q", "attn_k"):
            heads = cfg["num_attention_heads" if parts[-1] == "attn_q" else "num_key_value_heads"]
        yield name, GGUFWeight(t, quantized, heads)


def iter_gguf(
    file: GGUFFile, cfg: dict, quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """gguf_weights, each read whole."""
    for name, weight in gguf_weights(file, cfg, quantized):
        yield name, weight.read()
