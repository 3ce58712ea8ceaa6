import math

import torch
from torch import nn

from nanovllm.core.errors import ModelLoadError
from nanovllm.model.layers.compile import maybe_compiled
from nanovllm.model.layers.norm import fused_ops


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies of RoPE, with the config's scaling ("linear" or "llama3")."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_mid, mid, scaled)
    raise ModelLoadError(
        f"rope_scaling type {kind!r} is not supported; supported: default, linear, llama3"
    )


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (rotate halves) from a cos/sin table indexed by position."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                q_norm: nn.Module | None = None, k_norm: nn.Module | None = None):
        """RoPE on q [T, Hq, D] and k [T, Hkv, D], after the per-head RMSNorms of Qwen3
        when given; on CUDA one fused kernel does both, in place on q and k."""
        ops = fused_ops(q)
        if ops is not None:
            norms = () if q_norm is None else (q_norm.weight, k_norm.weight, q_norm.eps)
            return ops.qk_norm_rope(q, k, positions, self.cos, self.sin, *norms)
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        return apply_rotary(positions, q, k, self.cos, self.sin)


@maybe_compiled
def apply_rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
):
    cos = cos_table[positions].unsqueeze(1).to(q.dtype)
    sin = sin_table[positions].unsqueeze(1).to(q.dtype)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
