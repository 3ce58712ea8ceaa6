"""The examples' shared driver: nano-vLLM's Scheduler and BlockManager (nanovllm/core, no torch)
run step by step as LLMEngine.step runs them on a CPU (no overlap), with a stub in place of
the model: each sampling row "samples" `next_token(seq)` (7 unless told), and sequences end
by length. Each step prints one line and, given a trace file, writes the record the engine's
EngineTrace writes (nanovllm/core/trace.py), so `nanovllm trace FILE` draws it."""

import argparse
from collections.abc import Callable, Iterable

from nanovllm.core.block_manager import BlockManager
from nanovllm.core.config import EngineConfig, ResolvedConfig
from nanovllm.core.sampling_params import SamplingParams
from nanovllm.core.scheduler import Scheduler
from nanovllm.core.sequence import Sequence
from nanovllm.core.trace import SchedulerTrace


def parse_args(doc: str | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", metavar="FILE", help="also write the step trace (JSON lines) to "
                   "FILE; draw it with `nanovllm trace FILE -o PAGE.html` (default: none)")
    return p.parse_args()


class StubRunner:
    """A scheduler, its block manager and an optional StepTrace, built from a few settings
    (the rest as tests/core/scheduler_harness.py sets them)."""

    def __init__(self, *, policy: str = "prefill_first", block_size: int = 4,
                 num_blocks: int = 64, max_num_seqs: int = 8, max_num_batched_tokens: int = 16,
                 max_model_len: int = 1024, prefix_caching: bool = True,
                 next_token: Callable[[Sequence], int] = lambda seq: 7,
                 trace: str | None = None) -> None:
        self.config = ResolvedConfig(
            asked=EngineConfig(enable_prefix_caching=prefix_caching, scheduling_policy=policy),
            device="cpu", dtype="float32", max_model_len=max_model_len,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size, num_kv_blocks=num_blocks, admission_batch=1,
            cuda_graphs=False, overlap=False, kernels="torch", attention_backend="torch",
            num_threads=None)
        self.block_manager = BlockManager(num_blocks, block_size,
                                          enable_prefix_caching=prefix_caching)
        self.scheduler = Scheduler(self.config, self.block_manager)  # no EOS: ends by length
        self.next_token = next_token
        self.names: dict[int, str] = {}  # seq id -> its name, which is also its request id
        self.num_steps = 0
        # the engine's recorder; without a file it only builds each step's record to print
        self.trace = SchedulerTrace(trace, self.config, self.scheduler, self.block_manager)

    def add(self, name: str, num_tokens: int, max_tokens: int = 4, priority: int = 0) -> Sequence:
        """Queue a request of `num_tokens` prompt tokens (distinct per request: no prefix hits)."""
        seq_id = len(self.names)
        first = 1_000_000 * (seq_id + 1)
        seq = Sequence(seq_id, list(range(first, first + num_tokens)),
                       SamplingParams(max_tokens=max_tokens), priority=priority)
        self.names[seq_id] = name
        self.scheduler.add(seq)
        self.trace.arrived(name, seq)
        return seq

    def queue(self, seqs: Iterable[Sequence]) -> str:
        return "[" + ", ".join(self.names[s.seq_id] for s in seqs) + "]"

    def step(self) -> list[dict]:
        """One engine step: schedule, the stub forward pass, advance, resolve. Prints its line,
        writes its trace record, and returns its rows (as the trace has them)."""
        sched, trace = self.scheduler, self.trace
        start = trace.begin()
        batch = sched.schedule()
        trace.scheduled(batch)
        tokens = [self.next_token(s) for s in batch.sampling_seqs]  # the "model"
        sched.advance(batch)
        sched.resolve(batch.sampling_seqs, tokens)
        record = trace.end(start)
        print(self.describe(record))
        self.num_steps += 1
        return record["rows"]

    def describe(self, record: dict) -> str:
        """The step's line: rows, queues as the step ends, KV blocks as scheduled, events."""
        rows, preempted, finished = record["rows"], record["preempted"], record["finished"]
        usage = record["kv"]
        work = ", ".join(f"{r['req']} {r['kind']} {r['tokens']} "
                         f"({r['start']}->{r['start'] + r['tokens']})" for r in rows)
        dev = usage["device"]
        kv = f"kv {dev['used']} used, {dev['cached'] + dev['free']} free"
        if dev["cached"]:
            kv += f" ({dev['cached']} cached)"
        line = (f"step {self.num_steps:2d} | {work or 'nothing runs'} | "
                f"waiting {self.queue(self.scheduler.waiting)} "
                f"running {self.queue(self.scheduler.running)} | {kv}")
        if preempted:
            line += " | preempted " + ", ".join(f"{p['req']} ({p['kind']})" for p in preempted)
        if finished:
            line += " | finished " + ", ".join(f"{f['req']} ({f['reason']})" for f in finished)
        return line

    def run(self, max_steps: int = 10_000) -> None:
        """Steps until every request has finished."""
        while self.scheduler.has_unfinished():
            if self.num_steps >= max_steps:
                raise RuntimeError(f"still unfinished after {max_steps} steps")
            self.step()

    def close(self) -> None:
        self.trace.close()
