"""A tensor-parallel rank other than 0: it joins the group, builds its ModelRunner from
rank 0's WorkerInit, and runs what rank 0 sends (worker/messages.py) until Shutdown.
`nanovllm worker` runs it; so do `generate`, `chat` and `serve` on ranks other than 0."""

from __future__ import annotations

import logging
import os
import signal
import threading

import torch
import torch.distributed as dist

from nanovllm.core.errors import ConfigError
from nanovllm.model.parallel import TensorParallel
from nanovllm.worker.messages import (
    CONTROL,
    HEADER_LEN,
    STEP,
    MeasureKVBlocks,
    Setup,
    Shutdown,
    WorkerInit,
    step_header_len,
)
from nanovllm.worker.tp_group import (
    Rendezvous,
    join,
    leave_group,
    main_group,
    smallest,
)

log = logging.getLogger("nanovllm")


def _watch_parent() -> None:
    """A rank that rank 0 started (NANOVLLM_PARENT_FD): exit once rank 0 is gone, and not
    before it says so. A Ctrl-C or a supervisor's SIGTERM reaches the whole process group,
    this rank too; rank 0 (or the server's front end above it) stops in its own time and
    then stops this rank, so neither signal ends it here (SIGKILL still does)."""
    fd = os.environ.get("NANOVLLM_PARENT_FD")
    if fd is None:
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def wait() -> None:
        try:
            while os.read(int(fd), 1):
                pass
        except OSError:
            pass
        os._exit(0)

    threading.Thread(target=wait, name="nanovllm-parent-watch", daemon=True).start()


def run_worker(rdv: Rendezvous | None = None) -> int:
    """Serve as one rank (not 0) until rank 0 says Shutdown; returns the exit status.

    Without `rdv`, reads the env:// variables (`nanovllm worker` under torchrun or Slurm).
    """
    from nanovllm.model.config import ModelConfig
    from nanovllm.model.loader.source import open_model
    from nanovllm.worker.model_runner import ModelRunner

    rdv = rdv or Rendezvous.from_env()
    _watch_parent()
    if rdv is None or rdv.rank == 0:
        raise ConfigError(
            "`nanovllm worker` serves one rank other than 0: set RANK (>= 1), WORLD_SIZE, "
            "MASTER_ADDR and MASTER_PORT as for torchrun; rank 0 runs the engine"
        )
    join(rdv)
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    runner = None
    try:
        while True:
            dist.broadcast(header, 0)
            kind = int(header[0])
            if kind == STEP:
                _step(runner, header.tolist())
                continue
            assert kind == CONTROL, f"unknown header {kind}"
            box: list = [None]
            dist.broadcast_object_list(box, 0)
            match box[0]:
                case WorkerInit(model=path, config=config, eos_token_ids=eos):
                    tp = TensorParallel(rdv.rank, rdv.world_size,
                                        main_group(config, rdv.local_rank))
                    source = open_model(path)
                    runner = ModelRunner(config, source, ModelConfig.from_hf(source.hf_config),
                                         set(eos), tp=tp)
                    header = torch.zeros(step_header_len(config), dtype=torch.int64)
                case MeasureKVBlocks():
                    smallest(runner.measure_kv_blocks())
                case Setup(config=config):
                    runner.setup(config)
                case Shutdown():
                    break
    except RuntimeError as e:  # rank 0 (or another rank) is gone
        log.error("rank %d: the group broke (%s); leaving", rdv.rank, e)
        return 1
    finally:
        if runner is not None:
            runner.release_graphs()
        leave_group()
    return 0


def _step(runner, header: list[int]) -> None:
    _, tokens, sampling, padded, inline, max_q, max_ctx, n64, n32, n_out, n_in = \
        header[:HEADER_LEN]
    count = 2 * padded + 2 * (n_out + n_in)
    if inline:
        values = header[HEADER_LEN : HEADER_LEN + count]
    else:
        lists = torch.empty(count, dtype=torch.int64)
        dist.broadcast(lists, 0)
        values = lists.tolist()
    query_lens, context_lens = values[:padded], values[padded : 2 * padded]
    pairs = values[2 * padded :]
    copies = [(pairs[i], pairs[i + 1]) for i in range(0, len(pairs), 2)]
    if tokens == 0:  # KV copies alone
        runner.run_step(None, copies[:n_out], copies[n_out:])
        return
    buffers = runner.buffers
    dist.broadcast(buffers.dev64[:n64], 0, group=runner.tp.group)
    dist.broadcast(buffers.dev32[:n32], 0, group=runner.tp.group)
    runner.run_step(buffers.received(tokens, sampling, padded, max_q, max_ctx, query_lens,
                                     context_lens), copies[:n_out], copies[n_out:])
