import math

import torch
from torch import nn

from nanovllm.core.errors import ModelLoadError
from nanovllm.kernels import Kernels
from nanovllm.kernels.torch_ops import rope_rows


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

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None,
                 kernels: Kernels):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)
        self.kernels = kernels
        self._rows_for: torch.Tensor | None = None  # the positions of the last step's rows
        self._rows: tuple[torch.Tensor, torch.Tensor] = ()

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                q_norm: nn.Module | None = None, k_norm: nn.Module | None = None):
        """RoPE on q [T, Hq, D] and k [T, Hkv, D], after the per-head RMSNorms of Qwen3
        when given (the Triton kernel does both in one pass, in place on q and k)."""
        norms = () if q_norm is None else (q_norm.weight, k_norm.weight, q_norm.eps)
        if self.kernels.ops == "torch":  # each token's rows once per step, not per layer
            if positions is not self._rows_for:
                self._rows_for = positions
                self._rows = rope_rows(positions, self.cos, self.sin, q.dtype)
            return self.kernels.qk_norm_rope(q, k, None, *self._rows, *norms)
        return self.kernels.qk_norm_rope(q, k, positions, self.cos, self.sin, *norms)

    def and_store(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, q_norm: nn.Module | None, k_norm: nn.Module | None,
                  attn: nn.Module, slot_mapping: torch.Tensor):
        """`forward`, then `attn`'s K/V cache store of the rotated k and v, in one kernel
        (kernels.qk_norm_rope_store, which the caller checked is there)."""
        norms = () if q_norm is None else (q_norm.weight, k_norm.weight, q_norm.eps)
        return self.kernels.qk_norm_rope_store(q, k, v, positions, self.cos, self.sin,
                                               attn.k_cache, attn.v_cache, slot_mapping,
                                               *norms)
