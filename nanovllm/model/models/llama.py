"""The Llama decoder; Qwen2 (qkv bias) and Qwen3 (q/k RMSNorm) differ only by config flags."""

import torch
from torch import nn

from nanovllm.kernels import Kernels
from nanovllm.kernels.attention_metadata import AttentionMetadata
from nanovllm.model.config import ModelConfig
from nanovllm.model.layers.attention import Attention
from nanovllm.model.layers.embedding import LMHead, VocabEmbedding
from nanovllm.model.layers.linear import Linear, MergedLinear
from nanovllm.model.layers.norm import RMSNorm
from nanovllm.model.layers.rotary import RotaryEmbedding
from nanovllm.model.parallel import SINGLE, TensorParallel


class DecoderAttention(nn.Module):
    """Under tensor parallelism each rank runs its share of the query heads and the KV heads
    they read (TensorParallel.kv_heads); o_proj is row-parallel."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, kernels: Kernels,
                 tp: TensorParallel) -> None:
        super().__init__()
        D = self.head_dim = cfg.head_dim
        q_head, self.num_heads = tp.split(cfg.num_attention_heads, "attention heads")
        kv_head, self.num_kv_heads = tp.kv_heads(cfg.num_key_value_heads)
        q_size, kv_size = self.num_heads * D, self.num_kv_heads * D
        full_q, full_kv = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
        self.qkv_proj = MergedLinear(
            cfg.hidden_size, {"q": full_q, "k": full_kv, "v": full_kv}, bias=cfg.attention_bias,
            parts={"q": (q_head * D, q_size), "k": (kv_head * D, kv_size),
                   "v": (kv_head * D, kv_size)}, few_rows=kernels.small_linear,
        )
        # o_proj and down_proj feed a residual-add RMSNorm: they may return split-K partials
        self.o_proj = Linear(full_q, cfg.hidden_size, tp=tp, parallel="row",
                             few_rows=kernels.split_k_linear)
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, kernels)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, kernels)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, kernels)
        else:
            self.q_norm = self.k_norm = None
        self.sizes = [q_size, kv_size, kv_size]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.attn.kernels.qk_norm_rope_store is not None:  # RoPE and K/V store: one kernel
            q, k = self.rotary.and_store(positions, q, k, v, self.q_norm, self.k_norm, self.attn,
                                         meta.slot_mapping)
            o = self.attn(q, k, v, meta, stored=True)
        else:
            q, k = self.rotary(positions, q, k, self.q_norm, self.k_norm)
            o = self.attn(q, k, v, meta)
        return self.o_proj(o.flatten(1))


class MLP(nn.Module):
    """gate/up column-parallel, down row-parallel under tensor parallelism."""

    def __init__(self, cfg: ModelConfig, kernels: Kernels, tp: TensorParallel) -> None:
        super().__init__()
        size = cfg.intermediate_size
        self.gate_up_proj = MergedLinear(cfg.hidden_size, {"gate": size, "up": size}, tp=tp,
                                         few_rows=kernels.small_linear)
        self.down_proj = Linear(size, cfg.hidden_size, tp=tp, parallel="row",
                                few_rows=kernels.split_k_linear)
        self.silu_and_mul = kernels.silu_and_mul  # silu(gate) * up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, kernels: Kernels,
                 tp: TensorParallel) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(cfg, rotary, kernels, tp)
        self.mlp = MLP(cfg, kernels, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)

    def forward(self, x, residual, positions, meta):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_position: int, kernels: Kernels,
                 tp: TensorParallel) -> None:
        super().__init__()
        rotary = RotaryEmbedding(
            cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling, kernels
        )
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, rotary, kernels, tp) for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)

    def forward(self, input_ids, positions, meta):
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, meta)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    # checkpoint name part -> (our module name part, shard)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(self, cfg: ModelConfig, max_position: int, kernels: Kernels,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = cfg
        self.kernels = kernels
        self.tp = tp
        self.model = DecoderModel(cfg, max_position, kernels, tp)
        tied = self.model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, tied_to=tied, tp=tp)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]
