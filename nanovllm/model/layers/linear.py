import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x W^T (+ b). Checkpoint tensors are copied in by `weight_loader`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None):
        assert shard is None
        _copy_checked(param.data, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input in one matmul (q|k|v, or gate|up).

    `shards` names each part and its output size; the checkpoint stores them apart.
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shards.values()), bias)
        self.offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in shards.items():
            self.offsets[name] = (start, size)
            start += size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None):
        assert shard is not None
        start, size = self.offsets[shard]
        _copy_checked(param.data.narrow(0, start, size), loaded)


def _copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(
            f"checkpoint tensor has shape {tuple(src.shape)}, expected {tuple(dst.shape)}"
        )
    dst.copy_(src)
