import time
from collections import deque
from dataclasses import dataclass, field

from nanovllm.core.admission import Admission
from nanovllm.core.block_manager import BlockManager
from nanovllm.core.config import ResolvedConfig
from nanovllm.core.host_tier import PreemptionCost
from nanovllm.core.sequence import PLACEHOLDER, FinishReason, Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """What runs this step: each sequence with `num_scheduled_tokens` set.

    `sampling_seqs` (rows whose tokens are all computed after this step, so they sample one
    token each) is fixed when the batch is made, so it still holds after `advance`.
    """

    seqs: list[Sequence]
    sampling_seqs: list[Sequence] = field(init=False)
    # KV copies to run before the forward pass: out (device block, host slot) first, then
    # in (host slot, device block); see BlockManager
    copies_out: list[tuple[int, int]] = field(default_factory=list)
    copies_in: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sampling_seqs = [
            s for s in self.seqs if s.num_computed_tokens + s.num_scheduled_tokens == s.num_tokens
        ]

    def without_finished(self) -> "ScheduledBatch":
        """The batch less the sequences that ended since it was made; its copies kept."""
        return ScheduledBatch([s for s in self.seqs if not s.is_finished], self.copies_out,
                              self.copies_in)

    @property
    def has_copies(self) -> bool:
        return bool(self.copies_out or self.copies_in)

    @property
    def num_tokens(self) -> int:
        return sum(seq.num_scheduled_tokens for seq in self.seqs)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    """Decides which tokens of which sequences run each step, under a token and KV budget.

    Policies:
    - `fair`: every running sequence gets its decode token first, then prefill chunks
      (of running, then waiting sequences) fill the rest of the token budget.
    - `prefill_first`: the seed's behaviour; a step is either all prefill or all decode,
      only the first prefill of a step may be chunked, and a prompt's whole block table
      is allocated before its first chunk.
    Under KV pressure the sequence at the tail of `running` is preempted: its blocks are
    freed and it is recomputed later from its tokens, so no output is lost; with a host
    tier (swap_space), its full blocks are first copied to host memory when that costs less
    than recomputing them (`PreemptionCost`, preemption_mode), and copied back when it is
    admitted again. Each step's preemptions, with their kind, are in `preempted`.

    Priorities (`Sequence.priority`, lower first): `waiting` is kept ordered by priority,
    ties by arrival; a preempted sequence goes back to the front of its priority class.
    Under `fair`, victims of KV pressure are taken from the worst priority first (then the
    tail), and a waiting sequence that cannot be admitted preempts running sequences of
    strictly worse priority; `prefill_first` keeps the seed's tail-only preemption.

    Under `fair`, `Admission` (core/admission.py) also decides when a waiting prompt may
    join running work (admission batching and headroom); it reads the queues, never moves
    a sequence. Both policies, preemption and priorities stay one class: they act on the
    same two queues and block tables, and their invariants (tests/core) bind them all.
    """

    def __init__(
        self,
        config: ResolvedConfig,
        block_manager: BlockManager,
        eos_token_ids: set[int] | frozenset[int] = frozenset(),
        cost: PreemptionCost | None = None,
    ) -> None:
        self.policy = config.scheduling_policy
        self.swap = config.swap_space > 0 and config.preemption_mode != "recompute"
        self.preemption_mode = config.preemption_mode
        self.cost = cost
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_swaps = 0  # of those, by swap
        self.preempted: list[tuple[Sequence, str]] = []  # this step's, with "swap"/"recompute"
        self.admission = Admission(config, block_manager)
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found there

    # ---- queues -------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self._enqueue(seq, front_of_class=False)

    def _enqueue(self, seq: Sequence, front_of_class: bool) -> None:
        """Insert into `waiting` at the back (new) or front (preempted) of its priority."""
        w, p = self.waiting, seq.priority
        if not w or (w[-1].priority < p if front_of_class else w[-1].priority <= p):
            w.append(seq)  # the common case: every request has the same priority
        elif w[0].priority > p or (front_of_class and w[0].priority == p):
            w.appendleft(seq)
        else:
            i = next(i for i, s in enumerate(w)
                     if (s.priority >= p if front_of_class else s.priority > p))
            w.insert(i, seq)

    def _victim(self) -> Sequence:
        """The running sequence to preempt: worst priority, then the latest admitted."""
        worst = max(s.priority for s in self.running)
        return next(s for s in reversed(self.running) if s.priority == worst)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None):
        """End a sequence wherever it is (running, waiting, mid-prefill) and free its blocks."""
        if seq.status == SequenceStatus.FINISHED:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.token_ids and seq.token_ids[-1] == PLACEHOLDER:
            seq.token_ids.pop()  # ended while its last token was in flight: drop it
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        seq.num_scheduled_tokens = 0
        self.block_manager.free(seq)
        if seq.host_blocks:
            self.block_manager.release_host(seq)

    def _preempt(self, seq: Sequence) -> None:
        bm = self.block_manager
        self.admission.recount()
        holds = bm.swap_out(seq) if self._swap_pays(seq) else None
        self.running.remove(seq)
        bm.free(seq)
        if holds is not None:
            seq.host_blocks = holds
            self.num_swaps += 1
        self.preempted.append((seq, "recompute" if holds is None else "swap"))
        seq.status = SequenceStatus.WAITING
        seq.num_scheduled_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(seq, front_of_class=True)

    def _swap_pays(self, seq: Sequence) -> bool:
        if not self.swap or not seq.block_hashes:
            return False
        if self.preemption_mode == "swap" or self.cost is None:
            return True
        blocks = len(seq.block_hashes)
        tokens = blocks * self.block_manager.block_size
        return self.cost.swap_seconds(blocks) < self.cost.recompute_seconds(tokens)

    def _admit_prefix(self, seq: Sequence) -> None:
        """Look a fresh waiting sequence up in the prefix cache (takes refs on hits)."""
        if not seq.block_table:
            self.block_manager.allocate_cached_prefix(seq)

    def _undo_admit(self, seq: Sequence) -> None:
        if seq.block_table and seq.num_computed_tokens == seq.num_cached_prefix_tokens:
            self.block_manager.free(seq)

    def _count_prefix(self, seq: Sequence) -> None:
        """`seq` was admitted: count its prefix hits; a swapped sequence has its blocks
        back and lets go of their host copies."""
        self.block_manager.count_hits(seq)
        if seq.host_blocks:
            self.block_manager.release_host(seq)
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.monotonic()
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += seq.num_cached_prefix_tokens

    # ---- schedule -----------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        self.preempted = []
        if self.policy == "fair":
            batch = self._schedule_fair()
        else:
            batch = self._schedule_prefill_first()
        if batch:  # copies of an empty step wait for the next one that runs
            batch.copies_out, batch.copies_in = self.block_manager.take_copies()
        return batch

    def _schedule_prefill_first(self) -> ScheduledBatch:
        bm = self.block_manager
        scheduled: list[Sequence] = []
        budget = self.max_num_batched_tokens
        while self.waiting and len(self.running) + len(scheduled) < self.max_num_seqs and budget:
            seq = self.waiting[0]
            fresh = not seq.block_table
            if fresh:
                self._admit_prefix(seq)
            need = seq.num_tokens - seq.num_computed_tokens
            if need > budget and scheduled:
                if fresh:
                    self._undo_admit(seq)
                break
            if fresh:
                if not bm.allocate(seq, need):  # the whole block table, up front
                    self._undo_admit(seq)
                    break
                self._count_prefix(seq)
            seq.num_scheduled_tokens = min(need, budget)
            budget -= seq.num_scheduled_tokens
            scheduled.append(seq)
            if seq.num_scheduled_tokens == need:
                self.waiting.popleft()
                seq.status = SequenceStatus.RUNNING
                # `running` is extended after the loop so the max_num_seqs check sees both
        if scheduled:
            self.running.extend(s for s in scheduled if s.status == SequenceStatus.RUNNING)
            return ScheduledBatch(scheduled)

        # decode step: running keeps its order; preempt from the tail when out of blocks
        kept: list[Sequence] = []
        queue = deque(self.running)
        while queue and len(kept) < self.max_num_seqs:
            seq = queue.popleft()
            if self._will_stop_by_length(seq):
                continue
            while not bm.allocate(seq, 1):
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                seq.num_scheduled_tokens = 1
                kept.append(seq)
        return ScheduledBatch(kept)

    def _schedule_fair(self) -> ScheduledBatch:
        bm = self.block_manager
        self.admission.recount()
        budget = self.max_num_batched_tokens
        scheduled: list[Sequence] = []
        preempted = False
        # decoders first, so prefill work can never take their token
        decoding, prefilling = [], []
        for s in self.running:
            (prefilling if s.in_prefill else decoding).append(s)
        for seq in decoding + prefilling:
            if seq.status != SequenceStatus.RUNNING or self._will_stop_by_length(seq):
                continue  # preempted earlier in this loop, or ending with its last token
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n <= 0:
                continue
            while not bm.allocate(seq, n):
                slack = (len(seq.block_table) + bm.num_free_blocks) * bm.block_size
                fit = slack - seq.num_computed_tokens
                if fit > 0:
                    n = fit  # a smaller prefill chunk fits without preempting anyone
                    continue
                victim = self._victim()
                if victim in scheduled:
                    scheduled.remove(victim)
                    budget += victim.num_scheduled_tokens
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                seq.num_scheduled_tokens = n
                budget -= n
                scheduled.append(seq)

        if (self.waiting and not preempted
                and self.admission.hold(self.waiting, self.running, scheduled)):
            return ScheduledBatch(scheduled)
        # then new work, in priority and arrival order, while tokens, rows and blocks remain
        while self.waiting and budget and not preempted:
            seq = self.waiting[0]
            if len(self.running) >= self.max_num_seqs:
                if not self._preempt_for(seq, scheduled):
                    break
                budget = self.max_num_batched_tokens - sum(
                    s.num_scheduled_tokens for s in scheduled)
                continue
            self._admit_prefix(seq)
            if not self.admission.has_headroom(seq, self.running):
                self._undo_admit(seq)
                break
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not bm.allocate(seq, n):
                self._undo_admit(seq)
                if not self._preempt_for(seq, scheduled):
                    break
                budget = self.max_num_batched_tokens - sum(
                    s.num_scheduled_tokens for s in scheduled)
                continue
            self._count_prefix(seq)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self.admission.admitted(seq)
            seq.num_scheduled_tokens = n
            budget -= n
            scheduled.append(seq)
        return ScheduledBatch(scheduled)

    def _preempt_for(self, seq: Sequence, scheduled: list[Sequence]) -> bool:
        """Make room for waiting `seq` by preempting one running sequence of strictly worse
        priority (dropping it from this step's batch); False if there is none."""
        if not self.running:
            return False
        victim = self._victim()
        if victim.priority <= seq.priority:
            return False
        # a prompt left mid-prefill by this step must get the next step's leftover budget:
        # admitting another partial prompt beside it could starve it of a step
        if any(s is not victim and s.num_computed_tokens + s.num_scheduled_tokens < s.num_tokens
               for s in scheduled):
            return False
        if victim in scheduled:
            scheduled.remove(victim)
        self._preempt(victim)
        return True

    # ---- after the forward pass ----------------------------------------------

    def advance(self, batch: ScheduledBatch) -> None:
        """The batch was launched: count its tokens as computed and give each sampling row
        a placeholder token, so the next step can be scheduled before the sampled tokens
        reach the host (CPU/GPU overlap). `resolve` replaces the placeholders."""
        for seq in batch.seqs:
            if seq.is_finished:
                continue  # aborted or stopped while in flight
            samples = seq.num_computed_tokens + seq.num_scheduled_tokens == seq.num_tokens
            seq.num_computed_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            self.block_manager.register_full_blocks(seq)
            if samples:
                seq.append_token(PLACEHOLDER)

    def resolve(
        self, seqs: list[Sequence], token_ids: list[int],
        logprobs: list[dict[int, float] | None] | None = None,
    ) -> list[Sequence]:
        """Put the sampled tokens (and their logprobs, per row when asked for) in place of
        the placeholders and finish sequences that stop.

        Returns the sequences that took their token (not those that ended in flight).
        """
        accepted = []
        for i, (seq, token_id) in enumerate(zip(seqs, token_ids, strict=True)):
            if seq.is_finished:
                continue
            assert seq.token_ids[-1] == PLACEHOLDER, seq
            seq.token_ids[-1] = token_id
            if logprobs is not None and logprobs[i] is not None:
                seq.logprobs.append(logprobs[i])
            accepted.append(seq)
            reason = self._check_stop(seq, token_id)
            if reason is not None:
                self.finish(seq, *reason)
        return accepted

    def _will_stop_by_length(self, seq: Sequence) -> bool:
        # a placeholder that will end the sequence needs no further step
        max_tokens = seq.sampling_params.max_tokens
        return seq.num_tokens >= self.max_model_len or (
            max_tokens is not None and seq.num_output_tokens >= max_tokens
        )

    def _check_stop(self, seq: Sequence, token_id: int):
        sp = seq.sampling_params
        if seq.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and token_id in self.eos_token_ids:
                return FinishReason.STOP, None
            if token_id in sp.stop_token_ids:
                return FinishReason.STOP, token_id
        if self._will_stop_by_length(seq):
            return FinishReason.LENGTH, None
        return None
