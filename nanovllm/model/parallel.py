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

ONE_SHOT_MAX_BYTES = 8 << 20  # larger all-reduces (prefill steps) go to NCCL


class OneShotAllReduce:
    """A sum over the ranks in one kernel through torch.distributed's symmetric memory: each
    rank copies its tensor into a buffer every rank can address (over NVLink), waits for the
    others, reads every copy and adds them up, in rank order on every rank. For the small
    tensors of decode steps this is one launch and one peer read where NCCL runs a ring
    protocol (vLLM's custom all-reduce does the same with its own kernel).

    Built on every rank at the same point (the rendezvous is collective) and before CUDA
    graphs are captured; tensors of another dtype, over `max_bytes` or not 16-byte sized
    go to NCCL."""

    def __init__(self, group, dtype: torch.dtype, device: torch.device,
                 max_bytes: int = ONE_SHOT_MAX_BYTES) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.name = group.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # torch < 2.9 needs it; later ones take every group
            enable(self.name)
        self.buffer = symm_mem.empty(max_bytes // dtype.itemsize, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.name)
        ops = torch.ops.symm_mem
        self._copy_reduce = getattr(ops, "one_shot_all_reduce_copy", None)
        self._reduce = ops.one_shot_all_reduce

    def fits(self, x: torch.Tensor) -> bool:
        # 16-byte sizes and offset 0: the kernel's vector width must be the buffer's
        return (x.dtype == self.buffer.dtype and x.numel() <= self.buffer.numel()
                and x.is_contiguous() and x.storage_offset() == 0
                and x.numel() * x.element_size() % 16 == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x` (a new tensor)."""
        buf = self.buffer[: x.numel()]
        if self._copy_reduce is not None:  # the copy into the buffer is in the kernel
            out = self._copy_reduce(buf, x.view(-1), "sum", self.name)
        else:
            buf.copy_(x.view(-1))
            out = self._reduce(buf, "sum", self.name)
        return out.view(x.shape)


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in a tensor-parallel group; `group` is the torch.distributed
    process group the collectives run on (None when size == 1, or in loading tests);
    `one_shot` sums the tensors it fits (all_reduce="symm_mem"), NCCL the rest."""

    rank: int = 0
    size: int = 1
    group: Any = None
    one_shot: OneShotAllReduce | None = None

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
        """The sum of every rank's `x`: `x` itself, reduced in place, or a new tensor."""
        if self.size > 1:
            if self.one_shot is not None and self.one_shot.fits(x):
                return self.one_shot(x)
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
