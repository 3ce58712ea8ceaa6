import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.model.layers.quantized import QuantizedWeight, int4_linear, pack_int4


class Linear(nn.Module):
    """y = x W^T (+ b). Checkpoint tensors are copied in by `weight_loader`.

    A 4-bit checkpoint weight (QuantizedWeight) may stay packed: `finish_loading(packed=True)`
    then drops the dense weight and multiplies with torch's int4 CPU kernel.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        # never written when the weight stays packed, so its pages are never resident
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.quantized: dict[str | None, QuantizedWeight] = {}  # shard -> part, while loading
        self.packed: tuple[torch.Tensor, torch.Tensor] | None = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None):
        assert shard is None
        if isinstance(loaded, QuantizedWeight) and param is self.weight:
            _check_shape(param.shape, loaded.shape)
            self.quantized[None] = loaded
        else:
            _copy_checked(param.data, loaded)

    def _parts(self) -> list[QuantizedWeight]:
        return [self.quantized[None]] if None in self.quantized else []

    def finish_loading(self, packed: bool) -> str:
        """After every checkpoint tensor: pack the 4-bit weight (packed=True) or write it out
        dense. Returns the weight's form: "int4", "dense", or "dense (dequantized)"."""
        parts = self._parts()
        self.quantized = {}
        if not parts:
            return "dense"
        if packed and all(p.kind == "q4" for p in parts):
            self.packed = pack_int4(parts)
            self.weight = nn.Parameter(torch.empty(0, self.weight.shape[1]), requires_grad=False)
            return "int4"
        self.weight.data.copy_(torch.cat([p.dequantize() for p in parts]))
        return "dense (dequantized)"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            y = int4_linear(x, *self.packed)
            return y if self.bias is None else y + self.bias
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
        if isinstance(loaded, QuantizedWeight) and param is self.weight:
            _check_shape((size, param.shape[1]), loaded.shape)
            self.quantized[shard] = loaded
        else:
            _copy_checked(param.data.narrow(0, start, size), loaded)

    def _parts(self) -> list[QuantizedWeight]:
        if not self.quantized:
            return []
        if len(self.quantized) < len(self.offsets):  # some shards came dense: all dense
            for shard, part in self.quantized.items():
                start, size = self.offsets[shard]
                self.weight.data.narrow(0, start, size).copy_(part.dequantize())
            self.quantized = {}
            return []  # ("dense": the shards that came quantized are dequantized now)
        return [self.quantized[name] for name in self.offsets]  # in the merged order


def _check_shape(expected, got) -> None:
    if tuple(expected) != tuple(got):
        raise ValueError(f"checkpoint tensor has shape {tuple(got)}, expected {tuple(expected)}")


def _copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    _check_shape(dst.shape, src.shape)
    dst.copy_(src)
