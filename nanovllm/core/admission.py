"""When the `fair` scheduler lets a waiting prompt in beside running work: two gates that
read the scheduler's queues and change none of them (core/scheduler.py).

Admission batching (`admission_batch` > 1): while every running sequence is decoding and
fewer rows are free than `admission_batch` (or than there are waiting prompts), new prompts
wait, up to `admission_max_delay` steps. A step that carries any prefill runs eagerly on the
GPU, one of decodes only as a CUDA graph; admitting one prompt per freed row would make
nearly every step of a long queue a prefill step.

Admission headroom (admission_headroom > 0): a prompt waits while its whole remaining prompt
plus the next admission_headroom tokens of every running sequence do not fit in the free
blocks, unless nothing runs or it outranks running work; a burst then queues instead of being
admitted and preempted a few steps later.
"""

from collections import deque

from nanovllm.core.block_manager import BlockManager
from nanovllm.core.config import ResolvedConfig
from nanovllm.core.sequence import Sequence


class Admission:
    """The two gates of one scheduler, with what they remember between prompts and steps."""

    def __init__(self, config: ResolvedConfig, block_manager: BlockManager) -> None:
        self.batch = config.admission_batch
        self.max_delay = config.admission_max_delay
        self.headroom = config.admission_headroom
        self.max_num_seqs = config.max_num_seqs
        self.block_manager = block_manager
        self._held_steps = 0  # consecutive steps new prompts were held back
        # admission headroom of the step being scheduled: (worst running priority, blocks
        # the running sequences still need); None until asked, and after a preemption
        self._reserve: tuple[int, int] | None = None

    def recount(self) -> None:
        """`running` changed (a new step, a preemption): the next headroom check sums it
        again."""
        self._reserve = None

    def hold(self, waiting: deque[Sequence], running: list[Sequence],
             scheduled: list[Sequence]) -> bool:
        """Whether this decode-only step should leave the waiting prompts for a later one
        (admission batching). Never when nothing runs, when the step carries prefill
        already, when no row is free (priority preemption decides then), or when the head
        of the queue outranks a running sequence."""
        free = self.max_num_seqs - len(running)
        hold = (
            self.batch > 1
            and 0 < free < min(self.batch, len(waiting))
            and self._held_steps < self.max_delay
            and all(s.num_scheduled_tokens == 1 for s in scheduled)
            and waiting[0].priority >= max(s.priority for s in running)
        )
        self._held_steps = self._held_steps + 1 if hold else 0
        return hold

    def has_headroom(self, seq: Sequence, running: list[Sequence]) -> bool:
        """Whether admitting `seq` leaves its whole prompt and every running sequence's next
        admission_headroom tokens room in the free blocks."""
        h = self.headroom
        if not h or not running:
            return True
        if self._reserve is None:  # once a step (and after a preemption), not per prompt
            self._reserve = (max(s.priority for s in running),
                             sum(self._growth(s) for s in running))
        worst, reserved = self._reserve
        if seq.priority < worst:
            return True
        return self._growth(seq) + reserved <= self.block_manager.num_free_blocks

    def admitted(self, seq: Sequence) -> None:
        """`seq` runs now, its first chunk allocated: reserve what it still needs."""
        if self._reserve is not None:
            worst, reserved = self._reserve
            self._reserve = (max(worst, seq.priority), reserved + self._growth(seq))

    def _growth(self, seq: Sequence) -> int:
        """Blocks `seq` still needs for its prompt and admission_headroom more tokens."""
        n = seq.num_tokens - seq.num_computed_tokens + self.headroom
        return self.block_manager.blocks_needed(seq, n)
