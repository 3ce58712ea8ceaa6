from enum import Enum, StrEnum, auto

from nanovllm.core.sampling_params import SamplingParams

PLACEHOLDER = -1  # a sampled token still on the device (CPU/GPU overlap)


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class FinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    TIMEOUT = "timeout"
    ERROR = "error"


class Sequence:
    """One generation stream: its tokens, how many have KV in the cache, and its blocks.

    `num_computed_tokens` tokens have their K/V written to the cache; the step being
    scheduled computes `num_scheduled_tokens` more. A sequence samples a token on the
    step that brings `num_computed_tokens` up to `num_tokens`.
    """

    def __init__(
        self,
        seq_id: int,
        token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float = 0.0,
        priority: int = 0,
    ) -> None:
        self.seq_id = seq_id
        self.priority = priority  # lower runs first; ties by seq_id (arrival order)
        self.first_scheduled_time: float | None = None  # time.monotonic() when first admitted
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.num_computed_tokens = 0
        self.num_scheduled_tokens = 0
        self.num_cached_prefix_tokens = 0  # prefix-cache hits at the last admission
        self.num_host_prefix_blocks = 0  # of those, blocks copied back from the host tier
        # appended to while it lives, replaced by a new list when freed, never edited in
        # place: worker/inputs.py keeps each table's int32 copy by the list's identity
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # hashes of the leading full blocks, in order
        self.host_blocks: list[int] = []  # host-tier slots held while swapped out
        self.num_preemptions = 0
        self.logprobs: list[dict[int, float]] = []  # per output token, when asked for

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, status={self.status.name})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_resolved_tokens(self) -> int:
        """Tokens known on the host: all but a placeholder whose token is still on the
        device (with overlap, a launched step's token reaches the host a step later)."""
        n = len(self.token_ids)
        return n - 1 if self.token_ids[n - 1] == PLACEHOLDER else n

    @property
    def resolved_output_token_ids(self) -> list[int]:
        """The output tokens known on the host: what outputs may show."""
        return self.token_ids[self.num_prompt_tokens : self.num_resolved_tokens]

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def in_prefill(self) -> bool:
        """More than one token still lacks KV (a prompt, or a recompute after preemption)."""
        return self.num_tokens - self.num_computed_tokens > 1

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
