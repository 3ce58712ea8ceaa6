import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.model.layers.compile import maybe_compiled
from nanovllm.model.layers.norm import fused_ops


@maybe_compiled
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """silu(gate) * up over the merged [gate | up] projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = fused_ops(x)
        if ops is not None:
            return ops.silu_and_mul(x)
        return silu_and_mul(x)
