import torch
from torch import nn

from nanovllm.kernels import Kernels


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, optionally fused with the residual add before it."""

    def __init__(self, dim: int, eps: float, kernels: Kernels) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.kernels = kernels

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        # note: the Triton kernel updates `residual` in place (see triton.ops.add_rms_norm)
        return self.kernels.add_rms_norm(x, residual, self.weight, self.eps)
