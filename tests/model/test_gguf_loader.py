"""GGUF loading for each family: a tiny HF model written out as GGUF (the way llama.cpp's
converter lays it out) must generate exactly what transformers generates from the original."""

import json

import gguf
import numpy as np
import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.model.loader.gguf_file import read_gguf
from nanovllm.model.loader.source import default_model_path
from tests.support import hf_greedy

GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    # what llama.cpp's converter does to Llama q/k weights (interleaves the RoPE halves)
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def write_gguf(model_dir, out_path, arch: str) -> None:
    from transformers import AutoModelForCausalLM

    cfg = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    for added in tok["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    tokens += [f"<unused{i}>" for i in range(cfg["vocab_size"] - len(tokens))]
    w = gguf.GGUFWriter(str(out_path), GGUF_ARCH[arch])
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    w.add_value_length(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(cfg.get("rope_theta") or rope.get("rope_theta", 10000.0))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_eos_token_id(vocab["<|im_end|>"])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for name, t in model.state_dict().items():
        a = t.numpy().astype(np.float32)
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            if cfg.get("tie_word_embeddings"):
                continue
            gname = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, suffix = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{LAYER[module]}.{suffix}"
            if arch == "llama" and module == "self_attn.q_proj":
                a = _permute(a, heads)
            elif arch == "llama" and module == "self_attn.k_proj":
                a = _permute(a, kv_heads)
        w.add_tensor(gname, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_matches_transformers(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    arch = json.loads((tiny_model / "config.json").read_text())["model_type"]
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(tiny_model, path, arch)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    llm = LLM(str(path), device="cpu", block_size=4)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [300, 200, 100]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 6)
    assert llm.engine.eos_token_ids == {2}


def test_tensor_table_matches_gguf_reader():
    path = default_model_path()
    ours = read_gguf(path)
    ref = gguf.GGUFReader(str(path))
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors[:12], ref.tensors[:12]):
        assert a.qtype == b.tensor_type
        assert np.array_equal(np.asarray(a.data), np.asarray(b.data))


def test_corrupt_gguf_is_a_clear_error(tmp_path):
    from nanovllm import ModelLoadError

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 10)
    with pytest.raises(ModelLoadError, match="cannot read GGUF"):
        LLM(str(bad))
