"""Joining and leaving the tensor-parallel group: where the ranks meet (`Rendezvous`, the
env:// variables or a port rank 0 picked), the groups they form (gloo for control; NCCL for
the step on GPUs), and what a broken group raises. Used by both sides: rank 0's `Peers`
(tensor_parallel.py) and every other rank's `run_worker` (tp_worker.py)."""

from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from nanovllm.core.config import ResolvedConfig
from nanovllm.core.errors import ConfigError, NanoVLLMError

log = logging.getLogger("nanovllm")

# the control group waits for the next step as long as a server stays idle; a dead peer
# fails its collectives at once (the connection closes), so this is no liveness timeout
IDLE_TIMEOUT = timedelta(days=365)


class RankFailedError(NanoVLLMError):
    """A tensor-parallel rank died or left; the engine cannot continue."""


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet, and who this one is."""

    rank: int
    world_size: int
    local_rank: int  # the GPU this rank uses on its host
    addr: str
    port: int
    launched: bool = False  # by torchrun / Slurm / by hand: the env:// variables

    @classmethod
    def from_env(cls) -> Rendezvous | None:
        """The launcher's env:// variables, or None when WORLD_SIZE is not set."""
        if "WORLD_SIZE" not in os.environ:
            return None
        env = os.environ
        try:
            return cls(int(env["RANK"]), int(env["WORLD_SIZE"]),
                       int(env.get("LOCAL_RANK", 0)), env["MASTER_ADDR"],
                       int(env["MASTER_PORT"]), launched=True)
        except (KeyError, ValueError) as e:
            raise ConfigError(
                f"WORLD_SIZE is set, so the ranks meet through env://: set RANK, WORLD_SIZE, "
                f"MASTER_ADDR and MASTER_PORT (and LOCAL_RANK) to numbers and an address "
                f"({e!r} is missing or wrong)"
            ) from None

    @property
    def init_method(self) -> str:
        # env:// lets torch reuse torchrun's own store on MASTER_PORT (rank 0 would fail to
        # bind it again)
        return "env://" if self.launched else f"tcp://{self.addr}:{self.port}"


def join(rdv: Rendezvous) -> None:
    if dist.is_initialized():
        raise ConfigError(
            "this process already belongs to a torch.distributed group (another "
            "tensor-parallel engine?); shut that engine down first (LLM.shutdown())"
        )
    dist.init_process_group("gloo", init_method=rdv.init_method, rank=rdv.rank,
                            world_size=rdv.world_size, timeout=IDLE_TIMEOUT)


def main_group(config: ResolvedConfig, local_rank: int):
    """The group the step's tensors and the model's collectives run on."""
    if config.device != "cuda":
        return dist.group.WORLD
    torch.cuda.set_device(local_rank)
    return dist.new_group(backend="nccl")


def smallest(n: int) -> int:
    """The smallest of every rank's `n` (each rank calls this with its own), over the
    control group."""
    t = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(t, dist.ReduceOp.MIN)
    return int(t.item())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_collective_error(error: BaseException) -> bool:
    """An error a collective raised: torch's distributed errors, or gloo's RuntimeErrors
    (a peer's connection closed)."""
    dist_error = getattr(dist, "DistError", ())
    return isinstance(error, dist_error) or (
        isinstance(error, RuntimeError) and "gloo" in str(error).lower())


def leave_group(timeout: float = 15.0) -> None:
    """destroy_process_group, given `timeout` seconds: NCCL's teardown waits for the other
    ranks', and a rank that is gone must not hold this one at exit."""
    if not dist.is_initialized():
        return
    done = threading.Thread(target=dist.destroy_process_group, daemon=True)
    done.start()
    done.join(timeout)
    if done.is_alive():
        log.warning("leaving the tensor-parallel group took over %.0f s; left it behind",
                    timeout)
