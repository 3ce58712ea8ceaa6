"""The small per-token ops of a decoder layer in plain torch: the CPU path, the reference the
fused Triton kernels (triton/ops.py) are tested against, and what torch.compile fuses when
an engine asks for it."""

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 and cast back before the weight."""
    dtype = x.dtype
    if dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # the same in one op (CPU decode)
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual)."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def apply_rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style RoPE (rotate halves) of q [T, Hq, D] and k [T, Hkv, D] by position.
    `positions` None: the tables are already each token's rows (`rope_rows`)."""
    cos, sin = cos_table, sin_table
    if positions is not None:
        cos, sin = rope_rows(positions, cos_table, sin_table, q.dtype)
    heads = q.shape[1]
    qk = _rotate(torch.cat((q, k), dim=1), cos, sin)  # one pass over both: fewer host ops
    return qk[:, :heads], qk[:, heads:]


def rope_rows(positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's cos / sin over the whole head dim ([T, 1, D], both halves), in `dtype`:
    what every layer's RoPE multiplies by (RotaryEmbedding computes it once per step)."""
    cos = cos_table[positions].unsqueeze(1).to(dtype)
    sin = sin_table[positions].unsqueeze(1).to(dtype)
    return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), each product rounded to x's dtype
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optional per-head RMSNorm of q and k (Qwen3's q_norm / k_norm), then RoPE."""
    if q_weight is not None:
        q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    return apply_rotary(positions, q, k, cos, sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up over the merged [gate | up] projection."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
