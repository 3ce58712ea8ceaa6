import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.model.layers.compile import maybe_compiled


@maybe_compiled
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """silu(gate) * up over the merged [gate | up] projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
