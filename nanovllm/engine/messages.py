"""What crosses the pipe between the server's front end and its engine process.

One dataclass per message, pickled over one duplex multiprocessing Pipe; each side
dispatches with `match` on the type. The engine speaks no HTTP: a rejection carries a
`RejectReason`, and the front end picks the status code.

  front end -> engine: AddRequest | AbortRequest | StatsQuery | Shutdown
  engine -> front end: Ready | Fatal (first message, once) | Accepted | Rejected
      | Outputs (a step's Deltas) | Load (after steps, for placement) | StatsReply

Outputs and Delta go out every step, so they pickle as plain field tuples (`__reduce__`):
~2x faster over the pipe than a dataclass's default state dict.
"""

from dataclasses import dataclass, field
from enum import Enum

from nanovllm.core.config import EngineConfig
from nanovllm.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineProcessConfig:
    """Everything the engine process is started with."""

    model: str | None  # a model directory or .gguf file; None: the default model
    engine: EngineConfig = field(default_factory=EngineConfig)
    max_num_waiting: int | None = 256  # requests allowed to wait; more are rejected
    log_interval: float = 10.0  # seconds between engine status lines


# ---- front end -> engine ------------------------------------------------------------------


@dataclass
class AddRequest:
    """Queue a prompt; the engine answers Accepted or Rejected, then Deltas in Outputs."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0  # lower value is served first and may preempt worse running work
    timeout: float | None = None  # seconds from arrival; then finish_reason "timeout"
    stream: bool = True  # False: one Delta per completion, when it ends
    # False: Deltas carry token ids but no text (the front end decodes), unless stop strings
    # need the engine to decode
    detokenize: bool = True


@dataclass(frozen=True)
class AbortRequest:
    """End a request now and free its blocks; no reply (unknown ids are ignored)."""

    request_id: str


@dataclass(frozen=True)
class StatsQuery:
    """Ask for a StatsReply carrying the same `token`."""

    token: int


@dataclass(frozen=True)
class Shutdown:
    """Send what waits and exit."""


# ---- engine -> front end ------------------------------------------------------------------


@dataclass(frozen=True)
class EngineInfo:
    """What the engine process reports once its model is loaded."""

    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    eos_token_ids: tuple[int, ...]
    pid: int
    max_num_seqs: int  # rows in one step, as resolved for the device
    # chat replies, read by the front end (engine/chat_output.py): the reasoning parser and
    # the tool-call format (as configured, or read from the chat template), None for none
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None


@dataclass(frozen=True)
class Ready:
    """The engine has loaded its model and takes requests."""

    info: EngineInfo


@dataclass(frozen=True)
class Fatal:
    """The engine failed (to start, or later) and is exiting."""

    message: str


@dataclass(frozen=True)
class Accepted:
    """The request is queued; its Deltas follow."""

    request_id: str


class RejectReason(Enum):
    INVALID = "invalid"  # the request cannot run as given (prompt, sampling parameters)
    OVERLOADED = "overloaded"  # the waiting queue is full; the same request may pass later


@dataclass(frozen=True)
class Rejected:
    """The request was not queued, and why."""

    request_id: str
    reason: RejectReason
    message: str  # says what to change
    param: str | None = None  # the request field at fault (INVALID)
    code: str | None = None  # a machine-readable kind, e.g. "context_length_exceeded"
    retry_after: int | None = None  # seconds until it likely passes (OVERLOADED)


@dataclass
class Delta:
    """One completion's progress since its previous Delta."""

    request_id: str
    index: int
    text: str  # new text only: never broken UTF-8, never a stop string's prefix later cut
    token_ids: list[int]  # new token ids
    logprobs: list[dict[int, float]] | None  # one entry per new token, when asked for
    finish_reason: str | None
    stop_reason: int | str | None
    num_cached_tokens: int
    queue_time: float | None  # seconds waiting before first scheduled, once it is known

    def __reduce__(self):  # pickled as its fields alone: ~2x faster over the pipe
        return (Delta, (
            self.request_id, self.index, self.text, self.token_ids, self.logprobs,
            self.finish_reason, self.stop_reason, self.num_cached_tokens, self.queue_time,
        ))  # fmt: skip

    def merge(self, later: "Delta") -> "Delta":
        """This Delta followed by `later` (of the same completion), as one."""
        lps = self.logprobs
        if later.logprobs is not None:
            lps = later.logprobs if lps is None else lps + later.logprobs
        return Delta(
            self.request_id, self.index, self.text + later.text,
            self.token_ids + later.token_ids, lps, later.finish_reason, later.stop_reason,
            max(self.num_cached_tokens, later.num_cached_tokens),
            self.queue_time if self.queue_time is not None else later.queue_time,
        )  # fmt: skip


# a Delta as the engine builds it, its fields in order (LLMEngine.step_delta_rows): a tuple
# costs the engine's thread a tenth of what a Delta object does, on every row of every step
DeltaRow = tuple[str, int, str, list[int], list[dict[int, float]] | None, str | None,
                 int | str | None, int, float | None]


@dataclass
class Outputs:
    """Deltas of one or more steps, at most one per completion when merged."""

    deltas: list[Delta]

    def __reduce__(self):  # by columns, as OutputRows
        return OutputRows([(d.request_id, d.index, d.text, d.token_ids, d.logprobs,
                            d.finish_reason, d.stop_reason, d.num_cached_tokens,
                            d.queue_time) for d in self.deltas]).__reduce__()


@dataclass
class OutputRows:
    """A step's Deltas as the engine sends them: rows of their fields. It crosses the pipe
    as an Outputs (the receiver gets Delta objects), pickled by columns, a list per field:
    256 rows in ~25 us on a slow CPU against ~115 for 256 Delta objects' reduce calls."""

    rows: list[DeltaRow]

    def __reduce__(self):
        return (_outputs_from_columns, tuple(zip(*self.rows)))


def _outputs_from_columns(*columns) -> Outputs:
    return Outputs(list(map(Delta, *columns)) if columns else [])


@dataclass(frozen=True)
class Load:
    """The engine's queues and free KV blocks, what placement across data-parallel replicas
    weighs (entrypoints/openai/replicas.py). Sent to every front end after steps, at most
    every LOAD_INTERVAL seconds (engine_loop.py) and whenever the engine goes idle."""

    num_waiting: int
    num_running: int
    num_free_kv_blocks: int
    # AddRequests from this front end the engine has taken so far (queued or rejected):
    # the front end counts those sent since as not yet in num_waiting
    adds_seen: int

    def __reduce__(self):  # as Delta's: sent every few steps
        return (Load, (self.num_waiting, self.num_running, self.num_free_kv_blocks,
                       self.adds_seen))


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's queues, KV cache and counters (what /metrics shows)."""

    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage: float  # fraction of KV blocks in use, 0 to 1
    num_kv_blocks: int
    num_free_kv_blocks: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # prompt tokens found there
    num_preemptions: int
    num_swaps: int  # of those, by swap
    num_host_kv_blocks: int  # the host tier (0: none)
    num_free_host_kv_blocks: int
    kv_block_events: dict[str, int]  # BlockManager.events: hits by tier, copies
    prompt_tokens: int  # of accepted requests
    generation_tokens: int
    finished: dict[str, int]  # completions ended, by finish reason
    tokens_per_s: float  # generated since the last status line
    num_steps: int = 0  # engine steps run
    num_prefill_steps: int = 0  # of those, steps with prompt tokens (prefill or mixed)
    # the engine process's wall time by phase, in seconds since it started: between steps
    # idle (no work: asleep on the pipes), receive (taking messages while there is work),
    # send (Deltas to the front ends); within steps schedule, launch, wait (for the device),
    # postprocess, outputs (building the step's outputs; LLMEngine.timing)
    loop_seconds: dict[str, float] = field(default_factory=dict)
    # the engine process's garbage-collector pauses in seconds by generation (step_times.
    # GcPauses), and the objects its start-up left out of the collector's sight (freeze_heap)
    gc_seconds: dict[str, float] = field(default_factory=dict)
    gc_frozen_objects: int = 0


@dataclass(frozen=True)
class StatsReply:
    """The answer to the StatsQuery with the same `token`."""

    token: int
    stats: EngineStats


FrontEndMessage = AddRequest | AbortRequest | StatsQuery | Shutdown
EngineMessage = Ready | Fatal | Accepted | Rejected | Outputs | Load | StatsReply
