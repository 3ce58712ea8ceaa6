"""The engine process of the server: one LLMEngine stepping in a loop, fed over a pipe.

The HTTP front end (entrypoints/openai) runs in the parent process and does everything
that is not the engine loop: HTTP, JSON, tokenization, chat templates, SSE. Between every
step the loop drains the pipe (new requests, aborts, stats queries), so an abort frees its
KV blocks before the next step, and a burst of HTTP work never delays a GPU step.

Outputs leave through an `Outbox` (outbox.py) that writes only while the pipe has room, so
a step never waits for the front end either: while the front end is busy, new deltas merge
into those not yet sent, one per completion, and a slow front end gets fewer, larger deltas
instead of slowing the engine down.

Stop strings stay here, next to the scheduler: a stop string then ends its sequence in the
step that completed it (no tokens generated past it, usage exact), so a request with stop
strings is decoded here. A stream without them is decoded by the front end (AddRequest
detokenize=False): decoding every row on every step here cost a host-bound engine about a
tenth of its throughput, and the front end has a core to spare. What leaves is deltas: new
token ids (and new text where decoded here), built by the engine's delta outputs without
copying whole completions.

With several front-end processes (`nanovllm serve --api-server-count`) the engine has a
pipe to each, waits on all of them, and answers each request on the pipe it came from (an
Outbox per pipe). A pipe that closes stops the engine: a front end is gone, the server is
stopping or broken.

After its steps the engine tells every front end its Load (waiting and running requests,
free KV blocks), at most every LOAD_INTERVAL seconds and once more when it goes idle: with
data-parallel replicas the front ends place each request by it (replicas.py).

The messages both ways are the dataclasses of messages.py; the loop itself is
engine_loop.py (`EngineLoop`), this module the process around it: started, Ready or Fatal,
stopped.
"""

import gc
import logging
import multiprocessing
import os
import signal
from multiprocessing.connection import Connection

from nanovllm.engine.engine_loop import EngineLoop
from nanovllm.engine.messages import EngineInfo, EngineProcessConfig, Fatal, Ready

log = logging.getLogger("nanovllm.engine")


def start_engine(
    config: EngineProcessConfig, num_front_ends: int = 1
) -> tuple[multiprocessing.Process, list[Connection]]:
    """Spawn the engine process; returns it and the front ends' ends of its pipes, one per
    front-end process (`nanovllm serve --api-server-count`). The first message on each pipe
    is Ready or Fatal."""
    ctx = multiprocessing.get_context("spawn")
    pipes = [ctx.Pipe(duplex=True) for _ in range(num_front_ends)]
    proc = ctx.Process(
        target=run_engine_loop,
        args=([child for _, child in pipes], config),
        name="nanovllm-engine",
        daemon=True,
    )
    proc.start()
    for _, child in pipes:
        child.close()
    return proc, [parent for parent, _ in pipes]


def run_engine_loop(conns: list[Connection], config: EngineProcessConfig) -> None:
    """The engine process's main: load the model, report Ready (or Fatal) to every front
    end, serve the pipes."""
    # The front end stops this process (Shutdown, or its pipe closing). A terminal's Ctrl-C
    # reaches the whole process group, and so does a supervisor's SIGTERM (systemd's
    # default KillMode): ending here on either would fail the requests the front ends are
    # still draining (an interrupt would only print a traceback). SIGKILL still ends it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        from nanovllm.engine.llm_engine import LLMEngine

        engine = LLMEngine(config.model, config.engine)
    except Exception as e:  # a bad model path or config: the front end reports it
        log.exception("engine failed to start")
        for conn in conns:
            conn.send(Fatal(f"{type(e).__name__}: {e}"))
        return
    loop = EngineLoop(engine, conns, config)
    loop.gc_frozen_objects = freeze_heap()
    ready = Ready(EngineInfo(
        max_model_len=engine.max_model_len,
        vocab_size=engine.model_config.vocab_size,
        num_kv_blocks=engine.block_manager.num_blocks,
        block_size=engine.config.block_size,
        eos_token_ids=tuple(sorted(engine.eos_token_ids)),
        pid=os.getpid(),
        max_num_seqs=engine.config.max_num_seqs,
        reasoning_parser=engine.config.reasoning_parser,
        tool_call_parser=engine.tool_call_parser,
    ))  # fmt: skip
    for conn in conns:
        conn.send(ready)
    try:
        loop.run()
    except (EOFError, ConnectionError, KeyboardInterrupt):
        # a front end is gone: the server is stopping or broken, nothing to serve (its pipe
        # reads EOF, or ECONNRESET where it left replies unread; writes: EPIPE)
        pass


def freeze_heap() -> int:
    """Take what a server process holds once it has started (modules, the model's and the
    tokenizer's Python objects, the app) out of the garbage collector's sight: its full
    collections then walk only what the process made since. Left in, the ~300k objects of
    a start-up made each full collection a pause of ~80 ms on a slow CPU (~30 on the H200's
    host), and a stream of 256 rows allocates enough to set one off every ~130 steps.
    Returns how many objects are frozen (counted here once: the count walks them all)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
