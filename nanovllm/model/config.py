from dataclasses import dataclass, field

from nanovllm.core.errors import ModelLoadError

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass
class ModelConfig:
    """The shape of a decoder-only transformer, read from a Hugging Face config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    dtype: str  # float32 | bfloat16 | float16
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"architecture {archs or cfg.get('model_type')!r} is not supported; "
                f"supported: {', '.join(ARCHITECTURES)}"
            )
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or (
            rope if rope.get("rope_type", "default") != "default" else None
        )
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32").replace("torch.", "")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta") or rope.get("rope_theta", 10000.0),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            dtype=dtype if dtype in ("float32", "bfloat16", "float16") else "float32",
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
        )
