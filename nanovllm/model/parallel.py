"""Tensor parallelism as the model sees it: which slice of each weight this rank holds, and
the two collectives a sharded decoder needs (an all-reduce after row-parallel projections and
the vocab-parallel embedding, an all-gather of the LM head's vocab slices).

Megatron's split of a Llama layer: q/k/v and gate/up are column-parallel (each rank computes
its heads and its slice of the MLP's inner size, no communication), o and down are
row-parallel (each rank multiplies its input slice; the partial sums are all-reduced). The
embedding and the LM head split the vocabulary. With `size == 1` every method is a no-op,
so one model class serves both.
"""

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from nanovllm.core.errors import ConfigError


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in a tensor-parallel group; `group` is the torch.distributed
    process group the collectives run on (None when size == 1, or in loading tests)."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def split(self, total: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's equal share of `total` items."""
        if total % self.size:
            raise ConfigError(
                f"the model's {total} {what} cannot be split evenly over "
                f"tensor_parallel_size={self.size}; use a size that divides {total}"
            )
        n = total // self.size
        return self.rank * n, n

    def kv_heads(self, total: int) -> tuple[int, int]:
        """(first head, count) of the KV heads this rank holds: an equal share, or, with more
        ranks than KV heads, one head replicated over size // total ranks."""
        if total >= self.size:
            return self.split(total, "key/value heads")
        if self.size % total:
            raise ConfigError(
                f"the model's {total} key/value heads cannot be replicated evenly over "
                f"tensor_parallel_size={self.size}; use a multiple of {total}"
            )
        return self.rank // (self.size // total), 1

    def vocab_rows(self, vocab: int) -> tuple[int, int]:
        """(start, rows) of this rank's vocabulary slice, every slice ceil(vocab / size) rows
        (the last rank's tail past `vocab` is padding)."""
        rows = -(-vocab // self.size)
        return self.rank * rows, rows

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x`: `x` itself, reduced in place."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_vocab(self, x: torch.Tensor, vocab: int) -> torch.Tensor:
        """[rows, vocab] from each rank's [rows, vocab_rows] slice, on every rank."""
        if self.size == 1:
            return x
        rows = x.shape[0]
        parts = torch.empty((self.size * rows, x.shape[1]), dtype=x.dtype, device=x.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(parts, x.contiguous(), group=self.group)  # (named so from torch 2.13)
        return parts.view(self.size, rows, -1).permute(1, 0, 2).reshape(rows, -1)[:, :vocab]


SINGLE = TensorParallel()


def check_shardable(heads: int, kv_heads: int, intermediate: int, size: int) -> None:
    """Raise ConfigError, naming the dimension, when a model cannot be split over `size`
    ranks (checked before any rank starts)."""
    for rank in (0, size - 1):
        tp = TensorParallel(rank, size)
        tp.split(heads, "attention heads")
        tp.kv_heads(kv_heads)
        tp.split(intermediate, "MLP features (intermediate_size)")
