import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.model.layers.quantized import (
    QuantizedWeight,
    int4_linear,
    int8_linear,
    int8_rows,
    pack_int4,
    read_part,
)
from nanovllm.model.parallel import SINGLE, TensorParallel


class VocabEmbedding(nn.Module):
    """Token embeddings. A quantized checkpoint table may stay quantized (finish_loading):
    the rows a step looks up are dequantized as it runs.

    Vocab-parallel under tensor parallelism: each rank holds a slice of the vocabulary's
    rows (TensorParallel.vocab_rows), looks up the tokens that fall in it, zeros for the
    others, and the ranks' rows are all-reduced."""

    def __init__(self, vocab_size: int, dim: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        self.vocab_start, rows = tp.vocab_rows(vocab_size)
        self.vocab_rows = min(rows, vocab_size - self.vocab_start)  # rows the file has
        self.weight = nn.Parameter(torch.empty(rows, dim), requires_grad=False)
        self.table: QuantizedWeight | None = None

    def weight_loader(self, param: nn.Parameter, loaded, shard: str | None = None) -> None:
        self.table = _load_table(param, loaded, self)

    def finish_loading(self, weight_format: str) -> str:
        if self.table is None:
            return "dense"
        if weight_format in ("int4", "int4-bf16"):
            self.weight = nn.Parameter(torch.empty(0, self.weight.shape[1]), requires_grad=False)
            return self.table.kind
        self.weight.data.copy_(self.table.dequantize())
        self.table = None
        return "dense (dequantized)"

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._lookup(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_rows)
        x = self._lookup(local.masked_fill(outside, 0)).masked_fill(outside[:, None], 0)
        return self.tp.all_reduce(x)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.table is not None:
            return self.table.rows(ids).dequantize().to(torch.get_default_dtype())
        return F.embedding(ids, self.weight)


# An 8-bit LM head with one scale per row is ~1% off in each logit, enough to flip a near
# tie between the two likeliest tokens; each row's RESCORE_TOP likeliest are recomputed from
# the file's Q8_0 blocks in float32 (~0.1 ms a row), so greedy picks what the dense model
# picks (benchmarks/quant_accuracy.py measures both). 0 turns it off.
RESCORE_TOP = 8
# "int4-bf16" also keeps a bfloat16 copy of an 8-bit head for steps of this many rows or more:
# torch's int8 kernel is a loop of row products (1 / 8 / 16 rows: 0.99 / 3.19 / 6.46 ms for
# SmolLM2's 49,152 x 576 head on the 2-core VM), the bf16 matmul nearly flat (2.11 / 2.13 /
# 2.31 ms). The top logits are rescored from the file's blocks either way.
HEAD_BF16_FROM_ROWS = 8


class LMHead(nn.Module):
    """Logits in float32 for the rows that sample; shares the embedding when tied. From a
    quantized checkpoint it may stay quantized: 4-bit packed, or 8-bit with a scale per row
    (its top logits recomputed exactly, see RESCORE_TOP).

    Vocab-parallel under tensor parallelism: each rank computes the logits of its slice of
    the vocabulary, and every rank gets the whole row from an all-gather, so sampling
    (top-k/p, penalties, logprobs) sees exactly what one device would."""

    def __init__(
        self, vocab_size: int, dim: int, tied_to: VocabEmbedding | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        self.vocab_start, self.rows = tp.vocab_rows(vocab_size)
        self.vocab_rows = min(self.rows, vocab_size - self.vocab_start)
        self.tied_to = [tied_to] if tied_to is not None else []  # a list: not a submodule
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(self.rows, dim), requires_grad=False)
        self.table: QuantizedWeight | None = None
        self.int4: tuple[torch.Tensor, torch.Tensor] | None = None
        self.int8: tuple[torch.Tensor, torch.Tensor] | None = None
        self.bf16: torch.Tensor | None = None  # "int4-bf16": steps of HEAD_BF16_FROM_ROWS+

    def weight_loader(self, param: nn.Parameter, loaded, shard: str | None = None) -> None:
        self.table = _load_table(param, loaded, self)

    def finish_loading(self, weight_format: str) -> str:
        packed = weight_format in ("int4", "int4-bf16")
        table = self.tied_to[0].table if self.tied_to else self.table
        self.table = None
        if self.tied_to:
            self.weight = self.tied_to[0].weight  # the embedding's final form
        if table is None:
            return "dense"
        if not packed:
            if not self.tied_to:
                self.weight.data.copy_(table.dequantize())
            return "dense (dequantized)"
        self.weight = nn.Parameter(torch.empty(0, table.shape[1]), requires_grad=False)
        if table.kind == "q4":
            self.int4 = pack_int4([table])
            return "int4"
        self.int8 = int8_rows(table)
        self.table = table  # the exact blocks, for the top logits
        if weight_format == "int4-bf16":  # filled a slice at a time: no second whole copy
            self.bf16 = torch.empty(table.shape, dtype=torch.bfloat16)
            for start in range(0, table.shape[0], 4096):
                rows = slice(start, start + 4096)
                self.bf16[rows] = table.rows(rows).dequantize()
            return "int8 (a scale per row) + bf16 copy"
        return "int8 (a scale per row)"

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._logits(hidden)
        logits = self._logits(hidden)
        if logits.shape[1] < self.rows:  # a quantized table has no padding rows
            logits = F.pad(logits, (0, self.rows - logits.shape[1]))
        return self.tp.gather_vocab(logits, self.vocab_size)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.int4 is not None:
            return int4_linear(hidden, *self.int4)
        if self.int8 is not None:
            if self.bf16 is not None and hidden.shape[0] >= HEAD_BF16_FROM_ROWS:
                logits = F.linear(hidden.to(torch.bfloat16), self.bf16).to(hidden.dtype)
            else:
                logits = int8_linear(hidden, *self.int8)
            if RESCORE_TOP:
                top = logits.topk(RESCORE_TOP, dim=-1).indices  # [B, k]
                rows = self.table.rows(top.flatten()).dequantize().view(*top.shape, -1)
                exact = (rows @ hidden.float()[..., None]).squeeze(-1)
                logits.scatter_(-1, top, exact.to(logits.dtype))
            return logits
        return F.linear(hidden, self.weight)  # model dtype; the sampler upcasts what it needs


def _load_table(param: nn.Parameter, loaded, layer) -> QuantizedWeight | None:
    """A [vocab, dim] checkpoint tensor, this rank's rows of it: a quantized one is kept
    (returned) for finish_loading; a dense one is copied into `param`."""
    expected = (layer.vocab_size, param.shape[1])
    if tuple(loaded.shape) != expected:
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, "
                         f"expected {expected}")
    loaded = read_part(loaded, 0, layer.vocab_start, layer.vocab_rows)
    if isinstance(loaded, QuantizedWeight):
        return loaded
    param.data[: layer.vocab_rows].copy_(loaded)
    param.data[layer.vocab_rows :].zero_()  # the last rank's padding rows
    return None
