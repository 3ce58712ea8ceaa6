"""A Hugging Face model directory with random weights, built from a config.json.

Throughput does not depend on weight values, so a benchmark of Qwen3-0.6B's shape needs no
download: config.json, one model.safetensors of normal(0, 0.02) weights (norms = 1) under the
Hugging Face names, and a byte-level tokenizer small enough to write in a few lines.
"""

import json
from pathlib import Path

import torch

from benchmarks.workloads import QWEN3_CONFIG

# a checkpoint directory is complete once this file exists: a run killed mid-write rebuilds it
DONE_MARKER = ".complete"

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def weight_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Llama / Qwen2 / Qwen3 decoder, by its Hugging Face name."""
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    qk_norm = "Qwen3ForCausalLM" in cfg.get("architectures", [])
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg["vocab_size"], hidden)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (heads * head_dim, hidden)
        shapes[p + "self_attn.k_proj.weight"] = (kv_heads * head_dim, hidden)
        shapes[p + "self_attn.v_proj.weight"] = (kv_heads * head_dim, hidden)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, heads * head_dim)
        if qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (head_dim,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.up_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    if not cfg.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (cfg["vocab_size"], hidden)
    return shapes


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer with one word per model id ("t0" ... "t{V-1}", the specials at
    Qwen's ids): every id a random model samples decodes to visible text, so a streaming
    client sees each token arrive (serving benchmarks time them). Words it does not know
    encode to "t0"; token-id prompts need no encoding at all."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
    vocab = {f"t{i}": i for i in range(vocab_size) if i not in specials.values()}
    vocab.update({k: v for k, v in specials.items() if v < vocab_size})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([k for k, v in specials.items() if v < vocab_size])
    tok.save(str(path / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))


def build_random_model(cfg: dict, path: Path, seed: int = 0) -> tuple[Path, bool]:
    """Write (or reuse) a random-weight model directory for `cfg`; returns (path, built_now).

    A directory is reused only if it is complete and its config.json equals `cfg`, so a quick
    run's tiny model never stands in for the full one.
    """
    from safetensors.torch import save_file

    path = Path(path)
    config_file = path / "config.json"
    if (path / DONE_MARKER).is_file() and config_file.is_file():
        if json.loads(config_file.read_text()) == cfg:
            return path, False
    path.mkdir(parents=True, exist_ok=True)
    (path / DONE_MARKER).unlink(missing_ok=True)
    dtype = getattr(torch, str(cfg.get("torch_dtype", "bfloat16")).replace("torch.", ""))
    # the GPU draws 0.6B normals in well under a second; the CPU takes tens of seconds
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in weight_shapes(cfg).items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=dtype)
        else:
            t = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)
        tensors[name] = t.cpu().contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(path, cfg["vocab_size"])
    config_file.write_text(json.dumps(cfg, indent=2))
    (path / DONE_MARKER).write_text("ok\n")
    return path, True


QWEN3_8B = {  # Qwen3-8B's config.json, the fields a decoder reads
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 128,
    "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
    "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "vocab_size": 151936, "bos_token_id": 151643,
    "eos_token_id": 151645, "attention_bias": False, "hidden_act": "silu",
}
TINY = dict(QWEN3_8B, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=1024,
            torch_dtype="float32", tie_word_embeddings=True)


def shape_config(name: str) -> dict:
    """The config.json of a named shape: "8b", "0.6b" (Qwen3's) or "tiny" (a CPU smoke run's)."""
    if name == "0.6b":
        return json.loads(QWEN3_CONFIG.read_text())
    return {"8b": QWEN3_8B, "tiny": TINY}[name]


QWEN3_RANDOM_DIR = "/tmp/nanovllm-qwen3-0.6b-random"  # shared by the GPU benchmarks


def qwen3_random_model() -> Path:
    """The random-weight Qwen3-0.6B the GPU benchmarks share, built once in
    QWEN3_RANDOM_DIR (`python -m benchmarks.random_model` prints its path)."""
    return build_random_model(json.loads(QWEN3_CONFIG.read_text()), Path(QWEN3_RANDOM_DIR))[0]


if __name__ == "__main__":
    print(qwen3_random_model())
