from types import ModuleType

import torch
from torch import nn

from nanovllm.model.layers.compile import maybe_compiled

# devices whose tensors take the fused Triton kernels (layers/fused.py); tests add "cpu" to
# run them under Triton's interpreter
FUSED_DEVICES = {"cuda"}


def fused_ops(t: torch.Tensor) -> ModuleType | None:
    """The fused kernels module when they apply to `t` (on CUDA, while `fused.enabled()`).

    Imported only then, as attention.py imports its Triton backend, so CPU installs without
    triton never load it. The fused path takes precedence over `maybe_compiled`.
    """
    if t.device.type not in FUSED_DEVICES:
        return None
    from nanovllm.model.layers import fused

    return fused if fused.enabled() else None


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


rms_norm = maybe_compiled(_rms_norm)


@maybe_compiled
def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    residual = x + residual
    return _rms_norm(residual, weight, eps), residual  # the plain one: no compile in compile


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, optionally fused with the residual add before it."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        ops = fused_ops(x)
        if ops is not None:  # note: updates `residual` in place (see fused.add_rms_norm)
            if residual is None:
                return ops.rms_norm(x, self.weight, self.eps)
            return ops.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)
