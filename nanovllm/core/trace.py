"""A Scheduler's steps recorded in the step trace, whose format (`StepTrace`, `read_trace`)
is core/step_trace.py: the recorder sits above the scheduler it reads, the format below it."""

from typing import IO, TYPE_CHECKING

from nanovllm.core.step_trace import StepTrace, read_trace  # noqa: F401 (read_trace re-exported)

if TYPE_CHECKING:
    from nanovllm.core.block_manager import BlockManager
    from nanovllm.core.scheduler import ScheduledBatch, Scheduler
    from nanovllm.core.sequence import Sequence


class SchedulerTrace:
    """The step trace of a Scheduler and its BlockManager: each step's rows as scheduled
    (`scheduled`, before advance clears the counts), preemptions, KV blocks per tier, block
    events, arrivals and finishes (`end`). LLMEngine records one when `trace` is set; the
    examples' stub runner records one to print its steps."""

    def __init__(self, target: str | IO[str] | None, config, scheduler: "Scheduler",
                 block_manager: "BlockManager") -> None:
        self.scheduler, self.block_manager = scheduler, block_manager
        self.out = StepTrace(target)
        self.out.header(block_size=config.block_size, num_kv_blocks=config.num_kv_blocks,
                        num_host_blocks=config.num_host_blocks,
                        max_num_seqs=config.max_num_seqs,
                        max_num_batched_tokens=config.max_num_batched_tokens,
                        config=config.as_dict())
        self.live: dict[int, tuple[str, Sequence]] = {}  # seq id -> (request, sequence)
        self.events = dict(block_manager.events)
        self.rows: list[dict] = []
        self.preempted: list[dict] = []
        self.usage: dict = {}

    def arrived(self, request_id: str, seq: "Sequence") -> None:
        self.live[seq.seq_id] = (request_id, seq)
        self.out.arrived(request_id, seq.seq_id, seq.num_prompt_tokens, seq.priority)

    def begin(self) -> float:
        return self.out.now()

    def scheduled(self, batch: "ScheduledBatch") -> None:
        req = lambda seq: self.live.get(seq.seq_id, ("?", None))[0]
        self.rows = [
            {"req": req(s), "seq": s.seq_id, "tokens": s.num_scheduled_tokens,
             "kind": "prefill" if s.in_prefill else "decode",
             "start": s.num_computed_tokens, "total": s.num_tokens}
            for s in batch.seqs
        ]
        self.preempted = [{"req": req(s), "seq": s.seq_id, "kind": kind}
                          for s, kind in self.scheduler.preempted]
        self.usage = self.block_manager.usage()

    def end(self, start: float) -> dict:
        """The step that began at `start` is done: its record, written and returned."""
        out = self.out
        for seq_id, (request_id, seq) in list(self.live.items()):
            if seq.is_finished:
                out.finished(request_id, seq_id, str(seq.finish_reason), seq.num_output_tokens)
                del self.live[seq_id]
        events = self.block_manager.events
        delta = {k: v - self.events[k] for k, v in events.items()}
        self.events = dict(events)
        sched = self.scheduler
        record = out.step(start, out.now() - start, self.rows, len(sched.waiting),
                          len(sched.running), self.usage, delta, self.preempted)
        self.rows, self.preempted = [], []
        return record

    def close(self) -> None:
        self.out.close()
