"""GGUF files: the model config from metadata, weights dequantized with the `gguf` package."""

from collections.abc import Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from nanovllm.core.errors import ModelLoadError
from nanovllm.model.layers.quantized import QuantizedWeight, from_gguf_blocks
from nanovllm.model.loader.gguf_file import GGUFFile

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


def iter_gguf(
    file: GGUFFile, cfg: dict, quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """The file's tensors under Hugging Face names, dense float32; with `quantized`, Q4_0,
    Q4_1, Q4_K and Q8_0 weights come as QuantizedWeight (integers and scales as stored)."""
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
        q = from_gguf_blocks(t.data, t.qtype.name) if quantized and t.data.ndim == 2 else None
        if q is not None:
            if llama and parts[-1] in ("attn_q", "attn_k"):
                heads = cfg["num_attention_heads" if parts[-1] == "attn_q"
                            else "num_key_value_heads"]
                q = q.rows(torch.from_numpy(_unpermute(np.arange(q.shape[0]), heads)))
            yield name, q
            continue
        if t.qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            w = t.data.astype(np.float32)
        else:
            w = dequantize(t.data, t.qtype).astype(np.float32, copy=False)
        if llama and parts[-1] == "attn_q":
            w = _unpermute(w, cfg["num_attention_heads"])
        elif llama and parts[-1] == "attn_k":
            w = _unpermute(w, cfg["num_key_value_heads"])
        yield name, torch.from_numpy(np.ascontiguousarray(w))
