"""GGUF files written for tests, laid out the way llama.cpp's converter lays them out: a
byte-level BPE tokenizer, a model's hyperparameters, and its weights in any tensor type."""

import json
from collections.abc import Iterable, Sequence

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

# what llama.cpp names the tensors of a Hugging Face checkpoint
GGUF_GLOBAL_NAMES = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
}
GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# byte offsets of the f16 super-block scales d and dmin in each K-quant block (ggml-common.h);
# gguf.quants cannot quantize to these types, only dequantize them
K_QUANT_SCALES = {
    Q.Q2_K: (80, 82), Q.Q3_K: (108, None), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208, None),
}


def gguf_name(hf_name: str) -> str:
    """A Hugging Face checkpoint tensor's name in a GGUF file."""
    module, suffix = hf_name.rsplit(".", 1)
    if module in GGUF_GLOBAL_NAMES:
        return f"{GGUF_GLOBAL_NAMES[module]}.{suffix}"
    _, _, layer, rest = module.split(".", 3)
    return f"blk.{layer}.{GGUF_LAYER_NAMES[rest]}.{suffix}"


def permute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Llama q/k weights: interleave each head's RoPE halves."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def random_k_quant(shape: tuple[int, ...], qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """A tensor of K-quant blocks (uint8 rows): random bits, as every bit pattern is a valid
    block, but for the f16 super-block scales, set so the weights have mean 0 and std 0.15."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (*shape[:-1], shape[-1] // block * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)
    d_at, dmin_at = K_QUANT_SCALES[qtype]

    def with_scales(d: float, dmin: float) -> np.ndarray:
        blocks[:, d_at : d_at + 2] = np.array([d], np.float16).view(np.uint8)
        if dmin_at is not None:
            blocks[:, dmin_at : dmin_at + 2] = np.array([dmin], np.float16).view(np.uint8)
        return dequantize(raw, qtype)

    # weights are d * scaled quants - dmin * scaled mins: linear in (d, dmin)
    quants, mins = with_scales(1.0, 0.0), with_scales(0.0, 1.0)
    ratio = -quants.mean() / mins.mean() if dmin_at is not None else 0.0
    d = 0.15 / (quants + ratio * mins).std()
    with_scales(d, ratio * d)
    return raw


def encode(a: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """A float32 tensor as GGUF tensor data of `qtype`: float arrays for F32 and F16, rows of
    uint8 blocks otherwise. K-quants hold random blocks instead (see random_k_quant)."""
    if qtype == Q.F32:
        return a
    if qtype == Q.F16:
        return a.astype(np.float16)
    if qtype in K_QUANT_SCALES:
        return random_k_quant(a.shape, qtype, rng)
    return quantize(a, qtype)


def model_tensors(
    state_dict: dict, cfg: dict, qtypes: Q | Sequence[Q] = Q.F32, seed: int = 0
) -> list[tuple[str, np.ndarray, Q]]:
    """A Hugging Face model's tensors as GGUF names, data and types. 1-D tensors (norms, biases)
    stay F32 as llama.cpp keeps them; the others take `qtypes`, in turn when there are several."""
    turns = [qtypes] if isinstance(qtypes, Q) else list(qtypes)
    rng = np.random.default_rng(seed)
    out, matrices = [], 0
    for name, t in state_dict.items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        a = t.numpy().astype(np.float32)
        module = name.rsplit(".", 1)[0]
        if cfg["model_type"] == "llama" and module.endswith(("q_proj", "k_proj")):
            heads = "num_attention_heads" if module.endswith("q_proj") else "num_key_value_heads"
            a = permute_rope(a, cfg[heads])
        qtype = Q.F32
        if a.ndim > 1:
            qtype, matrices = turns[matrices % len(turns)], matrices + 1
        out.append((gguf_name(name), encode(a, qtype, rng), qtype))
    return out


def bpe_vocab(tokenizer_json: str, size: int = 0) -> tuple[list[str], list[str], set[str]]:
    """A tokenizers BPE's tokens in id order (padded with unused tokens up to `size`), its
    merges as "a b" strings, and its special tokens (llama.cpp's control tokens)."""
    spec = json.loads(tokenizer_json)
    vocab = dict(spec["model"]["vocab"])
    for added in spec["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = sorted(vocab, key=vocab.get)
    tokens += [f"<unused{i}>" for i in range(size - len(tokens))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return tokens, merges, {a["content"] for a in spec["added_tokens"] if a["special"]}


def byte_level_tokenizer() -> str:
    """tokenizer.json text of a byte-level BPE with no merges: the 256 byte symbols and three
    control tokens, for a model whose tests need a vocabulary but no real text."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate([*special, *sorted(pre_tokenizers.ByteLevel.alphabet())])}
    tok = Tokenizer(models.BPE(vocab, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in special])
    return tok.to_str()


def _add_hyperparameters(w: gguf.GGUFWriter, cfg: dict | None) -> None:
    if cfg is None:  # transformers reads a model config from a tokenizer's file too
        for add in (w.add_context_length, w.add_embedding_length, w.add_block_count,
                    w.add_feed_forward_length, w.add_head_count):
            add(8)
        return
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(cfg.get("rope_theta") or rope.get("rope_theta", 10000.0))


def write_gguf(
    path,
    arch: str = "llama",
    *,
    tokenizer_json: str,
    vocab_size: int = 0,
    tokenizer_model: str = "gpt2",
    pre: str | None = None,
    special: dict[str, str] | None = None,
    add_bos: bool | None = None,
    chat_template: str | None = None,
    config: dict | None = None,
    tensors: Iterable[tuple[str, np.ndarray, Q]] = (),
    alignment: int | None = None,
) -> str:
    """Write a GGUF file; returns its path.

    The vocabulary is `tokenizer_json`'s (a tokenizers BPE), padded to `vocab_size`;
    `special` names the token of each special id (`{"eos": "<|im_end|>"}`: bos, eos, eot...).
    `config` is a Hugging Face config (None: placeholders). `tensors` are (GGUF name, data as
    `encode` returns it, type), e.g. from `model_tensors`. `alignment` (a power of two) sets
    general.alignment: where tensor data starts, 32 bytes without it.
    """
    tokens, merges, control = bpe_vocab(tokenizer_json, vocab_size)
    ids = {t: i for i, t in enumerate(tokens)}
    w = gguf.GGUFWriter(str(path), arch)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    _add_hyperparameters(w, config)
    w.add_tokenizer_model(tokenizer_model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in control else 1 for t in tokens])  # 3: control, 1: normal
    w.add_token_merges(merges)
    for role, token in (special or {}).items():
        getattr(w, f"add_{role}_token_id")(ids[token])
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    for name, data, qtype in tensors:
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)
