"""What rank 0 tells the other tensor-parallel ranks (worker/tensor_parallel.py).

Each turn starts with a fixed int64 tensor on the control group (gloo, host memory): its
first entry says what follows. A step (STEP) is all tensors: the header and, in the same
tensor when they fit (they do unless a step copies many KV blocks), the host-side lists
(each row's query and context length, the step's KV copies), else in a second one; then
the step's input buffers themselves, broadcast on the main group (NCCL on GPUs, gloo on
CPUs) from where rank 0 prepared them; nothing per step is pickled. Start-up and shutdown
(CONTROL) send one of the dataclasses below, pickled, rarely.
"""

from dataclasses import dataclass
from pathlib import Path

from nanovllm.core.config import ResolvedConfig

# header[0]
STEP, CONTROL = 1, 2
# a STEP header: [STEP, tokens, sampling rows, padded rows, lists inline (1 / 0), max query
# length, max context length, int64 entries sent, int32 entries sent, copies out, copies in]
HEADER_LEN = 11
INLINE_COPY_INTS = 64  # room for 32 (source, destination) pairs after the rows' lengths


def step_header_len(config: ResolvedConfig) -> int:
    """The header tensor's length once WorkerInit is through (before it: HEADER_LEN): room
    for every buffer row's two lengths and a few KV copies."""
    return HEADER_LEN + 2 * config.max_num_seqs + INLINE_COPY_INTS


@dataclass(frozen=True)
class WorkerInit:
    """The first message: what to load and run with. Every rank opens `model` itself and
    reads only its shard of the weights."""

    model: Path
    config: ResolvedConfig
    eos_token_ids: frozenset[int]


@dataclass(frozen=True)
class MeasureKVBlocks:
    """Each rank measures how many KV blocks fit; all take the smallest (an all-reduce)."""


@dataclass(frozen=True)
class Setup:
    """The final config: allocate the KV cache and buffers, warm up, capture CUDA graphs."""

    config: ResolvedConfig


@dataclass(frozen=True)
class Shutdown:
    """Leave the loop and the process group."""


WorkerMessage = WorkerInit | MeasureKVBlocks | Setup | Shutdown
