"""Tensor parallelism across processes: one ModelRunner per rank, rank 0 in the engine.

Rank 0 schedules; every rank holds its shard of the model and of the KV cache
(model/parallel.py) and runs the same forward pass on the same inputs. Rank 0 drives the
others (`Peers`, here), each of which loops in `run_worker` (tp_worker.py): a step's
inputs are broadcast as tensors from rank 0's input buffers (worker/messages.py), the
forward pass's collectives keep the ranks in step, and only rank 0 samples (its LM head
gathers every vocab slice).

The ranks join through torch.distributed: a gloo group for the control messages (host
memory) and, on GPUs, an NCCL group for the step's tensors and the model's collectives. By
default rank 0 starts the other ranks on this machine (`tensor_parallel_size`); with the
standard env:// variables set (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK, as
torchrun and Slurm set them) every rank is started by the launcher, on as many hosts as it
likes, and ranks other than 0 run `nanovllm worker`. Meeting, joining and leaving the group
is tp_group.py's.

A rank that dies ends the engine: gloo fails the collective at once; a collective on NCCL
may wait forever for a dead peer, so when a rank this process started dies while rank 0 is
inside a step, a watchdog ends the process after DEAD_RANK_GRACE_S with the rank's exit code.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time

import torch
import torch.distributed as dist

from nanovllm.core.config import ResolvedConfig
from nanovllm.core.errors import ConfigError
from nanovllm.model.parallel import TensorParallel
from nanovllm.worker.inputs import StepInputs
from nanovllm.worker.messages import (
    CONTROL,
    HEADER_LEN,
    STEP,
    Shutdown,
    WorkerInit,
    WorkerMessage,
    step_header_len,
)
from nanovllm.worker.tp_group import (  # noqa: F401 (RankFailedError: raised to callers)
    RankFailedError,
    Rendezvous,
    free_port,
    is_collective_error,
    join,
    leave_group,
    main_group,
)

log = logging.getLogger("nanovllm")

DEAD_RANK_GRACE_S = 10.0


class Peers:
    """Rank 0's side of the group: starts (or meets) the other ranks, tells them what to do,
    broadcasts each step's inputs, and notices when one dies."""

    def __init__(self, model_path, config: ResolvedConfig, eos_token_ids: set[int]) -> None:
        size = config.tensor_parallel_size
        self.procs: list[subprocess.Popen] = []
        self.dead: str | None = None
        self.busy = 0  # >0 while rank 0 is inside a step or a start-up call
        self._closing = False
        rdv = Rendezvous.from_env()
        if rdv is None:
            rdv = Rendezvous(0, size, 0, "127.0.0.1", free_port())
            self._spawn(rdv)
        elif rdv.world_size != size or rdv.rank != 0:
            raise ConfigError(
                f"tensor_parallel_size={size} but the launcher started rank {rdv.rank} of "
                f"WORLD_SIZE={rdv.world_size}: run the engine on rank 0 with "
                f"--tensor-parallel-size {rdv.world_size}, `nanovllm worker` on the others"
            )
        log.info("tensor parallelism: %d ranks meeting at %s", size, rdv.init_method)
        if self.procs:  # from here on: a rank that dies cannot leave rank 0 waiting
            threading.Thread(target=self._watch, name="nanovllm-tp-watchdog",
                             daemon=True).start()
        try:
            with self.busy_section():
                join(rdv)
        except BaseException:
            self._stop_procs(told=False)  # the group never formed: no rank was told to leave
            raise
        self.control_group = dist.group.WORLD
        self._header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        try:
            self.control(WorkerInit(model_path, config, frozenset(eos_token_ids)))
            self._header = torch.zeros(step_header_len(config), dtype=torch.int64)
            with self.busy_section():  # the step's tensors and the model's collectives
                self.tp = TensorParallel(0, size, main_group(config, rdv.local_rank))
        except BaseException as e:
            self.dead = self.dead or f"start-up failed ({type(e).__name__}: {e})"
            self.shutdown()
            raise

    def _spawn(self, rdv: Rendezvous) -> None:
        """Start ranks 1.. on this machine as `python -m nanovllm worker` with the env://
        variables set, each holding the read end of a pipe: EOF there means rank 0 is gone."""
        read, self._alive = os.pipe()
        try:
            for rank in range(1, rdv.world_size):
                env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank),
                           WORLD_SIZE=str(rdv.world_size), MASTER_ADDR=rdv.addr,
                           MASTER_PORT=str(rdv.port), NANOVLLM_PARENT_FD=str(read),
                           NANOVLLM_LOG_LEVEL=str(log.getEffectiveLevel()))
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "nanovllm", "worker"], env=env, pass_fds=(read,)))
        finally:
            os.close(read)

    # ---- messages ---------------------------------------------------------------------

    def control(self, msg: WorkerMessage) -> None:
        """Send a start-up message to every rank."""
        self.check()
        with self.busy_section():
            self._broadcast_control(msg)

    def _broadcast_control(self, msg: WorkerMessage) -> None:
        self._header.zero_()
        self._header[0] = CONTROL
        dist.broadcast(self._header, 0, group=self.control_group)
        dist.broadcast_object_list([msg], 0, group=self.control_group)

    def send_step(self, inputs: StepInputs, buffers, copies_out, copies_in) -> None:
        """The step's inputs to every rank: the header and host lists on the control group,
        the input buffers (where rank 0 prepared them, placeholders filled) on the main."""
        meta = inputs.meta
        n64 = 3 * buffers.T + inputs.num_sampling_rows
        n32 = buffers.tables_at + inputs.padded_rows * buffers.W
        self._send_header(
            [inputs.input_ids.shape[0], inputs.num_sampling_rows, inputs.padded_rows, 0,
             meta.max_query_len, meta.max_context_len, n64, n32],
            meta.query_lens_host + meta.context_lens_host, copies_out, copies_in)
        dist.broadcast(buffers.dev64[:n64], 0, group=self.tp.group)
        dist.broadcast(buffers.dev32[:n32], 0, group=self.tp.group)

    def send_copies(self, copies_out, copies_in) -> None:
        """A step of KV copies alone (every row of the batch had finished)."""
        self._send_header([0] * 8, [], copies_out, copies_in)

    def _send_header(self, sizes: list[int], lists: list[int], copies_out, copies_in) -> None:
        self.check()
        for pairs in (copies_out, copies_in):
            for a, b in pairs:
                lists += (a, b)
        h = self._header
        end = HEADER_LEN + len(lists)
        inline = end <= h.numel()
        sizes[3] = int(inline)
        h[:HEADER_LEN] = torch.tensor([STEP, *sizes, len(copies_out), len(copies_in)])
        if inline and lists:
            h[HEADER_LEN:end] = torch.tensor(lists)
        dist.broadcast(h, 0, group=self.control_group)
        if not inline:  # many KV copies: the lists follow on their own
            dist.broadcast(torch.tensor(lists, dtype=torch.int64), 0, group=self.control_group)

    # ---- liveness ---------------------------------------------------------------------

    def check(self) -> None:
        if self.dead is not None:
            raise RankFailedError(f"{self.dead}; the engine cannot continue: start it again")

    def busy_section(self) -> _Busy:
        return _Busy(self)

    def step_failed(self, error: BaseException) -> BaseException:
        """What to raise for an error out of a step. After any, the ranks are out of step
        (the others wait in a collective rank 0 never reaches), so later calls raise
        RankFailedError: a collective's failure says which rank died; rank 0's own error
        (out of memory, Ctrl-C) is raised as it is."""
        if isinstance(error, RankFailedError):
            return error
        if self.dead is not None or any(p.poll() is not None for p in self.procs) \
                or is_collective_error(error):
            return self.failure(error)
        self.dead = (f"rank 0 stopped in the middle of a step ({type(error).__name__}: "
                     f"{error}), so the ranks are out of step")
        return error

    def failure(self, error: BaseException) -> BaseException:
        """What to raise for an error out of a collective: the dead rank, when one is."""
        for _ in range(20):  # the process may end just after its sockets close
            if self.dead is not None or any(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.05)
        gone = [p for p in self.procs if p.poll() is not None]
        if self.dead is None and gone:
            self.dead = self._describe(gone[0])
        if self.dead is None:
            self.dead = f"a tensor-parallel collective failed ({error})"
        return RankFailedError(f"{self.dead}; the engine cannot continue: start it again")

    def _describe(self, proc) -> str:
        rank = self.procs.index(proc) + 1
        return f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.returncode}"

    def _watch(self) -> None:
        while not self._closing:
            gone = [p for p in self.procs if p.poll() is not None]
            if gone:
                break
            time.sleep(0.2)
        if self._closing:
            return
        self.dead = self._describe(gone[0])
        log.error("%s; the engine cannot continue", self.dead)
        deadline = time.monotonic() + DEAD_RANK_GRACE_S
        while time.monotonic() < deadline:
            if not self.busy or self._closing:
                return  # not waiting on the dead rank: the next call raises RankFailedError
            time.sleep(0.1)
        print(f"nanovllm: {self.dead}; rank 0 was waiting on it in a collective, "
              "so the process ends here", file=sys.stderr, flush=True)
        os._exit(1)

    # ---- the end ----------------------------------------------------------------------

    def shutdown(self) -> None:
        """Tell every rank to leave, wait for the ones this process started, and leave the
        group; safe to call twice."""
        if self._closing:
            return
        self._closing = True
        told = self.dead is None
        if told:
            try:
                self._broadcast_control(Shutdown())
            except RuntimeError:
                told = False  # a rank is gone already
        leave_group()  # while the other ranks leave theirs: NCCL's teardown meets them
        self._stop_procs(told)

    def _stop_procs(self, told: bool = True) -> None:
        """Wait for the ranks this process started, then close their pipe (EOF ends any
        that lingers). Ranks not `told` to leave (the group never formed, or is out of step)
        could only wait: their pipe closes first."""
        self._closing = True
        if self.procs and not told:
            os.close(self._alive)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.procs and told:
            os.close(self._alive)
        self.procs = []


class _Busy:
    def __init__(self, peers: Peers) -> None:
        self.peers = peers

    def __enter__(self) -> None:
        self.peers.busy += 1

    def __exit__(self, *exc) -> None:
        self.peers.busy -= 1
