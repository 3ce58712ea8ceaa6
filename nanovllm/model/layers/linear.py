import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.model.layers.quantized import QuantizedWeight, int4_linear, pack_int4

# weight_format "int4-bf16": steps of at least this many token rows (prefill) multiply by a
# bfloat16 copy of the 4-bit weight, 2.5x faster there than the int4 kernel on a CPU with
# bf16 matrix units; fewer rows (decode, batches of up to 31) use the int4 kernel. Measured
# in the engine: a 512-token prompt 984 -> 1,730 tok/s; 16 decode rows were slower on the
# copy (332 against 403 tok/s), hence 32, not the bare matmul's crossover of ~8 rows.
BF16_FROM_ROWS = 32


class Linear(nn.Module):
    """y = x W^T (+ b). Checkpoint tensors are copied in by `weight_loader`.

    A 4-bit checkpoint weight (QuantizedWeight) may stay packed (`finish_loading`, weight
    format "int4" or "int4-bf16"): the dense weight is dropped and torch's int4 CPU kernel
    multiplies; "int4-bf16" also keeps a bfloat16 copy for steps of many rows.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        # never written when the weight stays packed, so its pages are never resident
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.quantized: dict[str | None, QuantizedWeight] = {}  # shard -> part, while loading
        self.packed: tuple[torch.Tensor, torch.Tensor] | None = None
        self.bf16: torch.Tensor | None = None  # "int4-bf16": steps of BF16_FROM_ROWS+ rows

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None):
        assert shard is None
        if isinstance(loaded, QuantizedWeight) and param is self.weight:
            _check_shape(param.shape, loaded.shape)
            self.quantized[None] = loaded
        else:
            _copy_checked(param.data, loaded)

    def _parts(self) -> list[QuantizedWeight]:
        return [self.quantized[None]] if None in self.quantized else []

    def finish_loading(self, weight_format: str) -> str:
        """After every checkpoint tensor: pack the 4-bit weight ("int4", "int4-bf16") or write it
        out dense. Returns the weight's form, as the load log counts them."""
        parts = self._parts()
        self.quantized = {}
        if not parts:
            return "dense"
        if weight_format in ("int4", "int4-bf16") and all(p.kind == "q4" for p in parts):
            self.packed = pack_int4(parts)
            self.weight = nn.Parameter(torch.empty(0, self.weight.shape[1]), requires_grad=False)
            if weight_format == "int4":
                return "int4"
            self.bf16 = torch.cat([p.dequantize() for p in parts]).to(torch.bfloat16)
            return "int4 + bf16 copy"
        self.weight.data.copy_(torch.cat([p.dequantize() for p in parts]))
        return "dense (dequantized)"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            if self.bf16 is not None and x.shape[0] >= BF16_FROM_ROWS:  # x: [T, K]
                y = F.linear(x.to(torch.bfloat16), self.bf16).to(x.dtype)
            else:
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
