from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.model.layers.quantized import QuantizedWeight, int4_linear, pack_int4, read_part
from nanovllm.model.parallel import SINGLE, TensorParallel

# weight_format "int4-bf16": steps of at least this many token rows (prefill) multiply by a
# bfloat16 copy of the 4-bit weight, faster there than the int4 kernel on a CPU with bf16
# matrix units; fewer rows (decode) use the int4 kernel, which the engine measured faster
# up to batches of 16 decode rows, hence 32 and not the bare matmul's crossover.
BF16_FROM_ROWS = 32


class Linear(nn.Module):
    """y = x W^T (+ b). Checkpoint tensors are copied in by `weight_loader`.

    Under tensor parallelism (`tp`, model/parallel.py) a "column" linear holds a slice of
    the output rows (no communication) and a "row" linear a slice of the input columns, its
    partial products all-reduced (the bias added once, after). Each rank reads only its
    slice of the checkpoint tensor.

    A 4-bit checkpoint weight (QuantizedWeight) may stay packed (`finish_loading`, weight
    format "int4" or "int4-bf16"): the dense weight is dropped and torch's int4 CPU kernel
    multiplies; "int4-bf16" also keeps a bfloat16 copy for steps of many rows.

    `few_rows` (one rank, no bias): a kernel tried first, for steps of few rows, returning
    the output or None for the plain matmul. Kernels.split_k_linear's output is split-K
    partial products (triton.linear.SplitK) that only a residual-add RMSNorm consumes, so the
    model gives it only to projections that feed one; Kernels.small_linear's is the plain
    output (triton.linear.small_linear).
    """

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False,
        tp: TensorParallel = SINGLE, parallel: str | None = None,
        few_rows: Callable | None = None,
    ) -> None:
        super().__init__()
        self.tp, self.parallel = tp, parallel if tp.size > 1 else None
        self.few_rows = few_rows if tp.size == 1 and not bias else None
        self.full_shape = (out_features, in_features)
        self.part: tuple[int, int, int] | None = None  # (dim, start, length) of the checkpoint
        if self.parallel == "column":
            start, out_features = tp.split(out_features, "output features")
            self.part = (0, start, out_features)
        elif self.parallel == "row":
            start, in_features = tp.split(in_features, "input features")
            self.part = (1, start, in_features)
        # never written when the weight stays packed, so its pages are never resident
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.quantized: dict[str | None, QuantizedWeight] = {}  # shard -> part, while loading
        self.packed: tuple[torch.Tensor, torch.Tensor] | None = None
        self.bf16: torch.Tensor | None = None  # "int4-bf16": steps of BF16_FROM_ROWS+ rows

    def weight_loader(self, param: nn.Parameter, loaded, shard: str | None = None):
        assert shard is None
        full = self.full_shape if param is self.weight else self.full_shape[:1]
        _check_shape(full, loaded.shape)
        part = self.part
        if part is not None and (param is self.weight or part[0] == 0):
            loaded = read_part(loaded, *part)
        else:
            loaded = read_part(loaded)
        if isinstance(loaded, QuantizedWeight) and param is self.weight:
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
        if self.few_rows is not None and self.packed is None:
            y = self.few_rows(x, self.weight)  # None: more rows than it pays for
            if y is not None:
                return y
        if self.packed is not None:
            if self.bf16 is not None and x.shape[0] >= BF16_FROM_ROWS:  # x: [T, K]
                y = F.linear(x.to(torch.bfloat16), self.bf16).to(x.dtype)
            else:
                y = int4_linear(x, *self.packed)
        elif self.parallel != "row":
            return F.linear(x, self.weight, self.bias)
        else:
            y = F.linear(x, self.weight)
        if self.parallel == "row":  # partial sums: the bias goes on once, after
            y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


class MergedLinear(Linear):
    """Several projections of the same input in one matmul (q|k|v, or gate|up).

    `shards` names each part and its output size; the checkpoint stores them apart. Under
    tensor parallelism it is column-parallel: `parts` gives each shard's (start, length) in
    its checkpoint tensor's rows (by default an equal split; key/value heads may be
    replicated, see TensorParallel.kv_heads).
    """

    def __init__(
        self, in_features: int, shards: dict[str, int], bias: bool = False,
        tp: TensorParallel = SINGLE, parts: dict[str, tuple[int, int]] | None = None,
        few_rows: Callable | None = None,
    ) -> None:
        if parts is None:
            parts = {name: tp.split(size, "output features") for name, size in shards.items()}
        super().__init__(in_features, sum(n for _, n in parts.values()), bias,
                         few_rows=few_rows if tp.size == 1 else None)
        self.full_sizes = dict(shards)
        self.sources = parts  # shard -> (start, length) in the checkpoint tensor
        self.offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, (_, size) in parts.items():
            self.offsets[name] = (start, size)
            start += size

    def weight_loader(self, param: nn.Parameter, loaded, shard: str | None = None):
        assert shard is not None
        start, size = self.offsets[shard]
        full = self.full_sizes[shard]
        _check_shape((full, param.shape[1]) if param is self.weight else (full,), loaded.shape)
        src_start, src_len = self.sources[shard]
        loaded = read_part(loaded, 0, src_start, src_len)
        if isinstance(loaded, QuantizedWeight) and param is self.weight:
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
