"""The scheduler driven like the engine drives it, with a fake model and no torch: what
tests/core/test_scheduler*.py share."""

from nanovllm.core.block_manager import BlockManager
from nanovllm.core.config import EngineConfig, ResolvedConfig
from nanovllm.core.sampling_params import SamplingParams
from nanovllm.core.scheduler import PLACEHOLDER, Scheduler
from nanovllm.core.sequence import FinishReason, Sequence, SequenceStatus

EOS = 2
STOP_ID = 5


def make_scheduler(
    policy: str = "fair",
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 4,
    max_num_batched_tokens: int = 16,
    max_model_len: int = 64,
    prefix_caching: bool = True,
    admission_batch: int = 1,
    admission_max_delay: int = 16,
    admission_headroom: int = 0,
    num_host_blocks: int = 0,
    swap: bool = False,
    offload: bool = False,
    preemption_mode: str = "auto",
    cost=None,
) -> Scheduler:
    asked = EngineConfig(
        enable_prefix_caching=prefix_caching, scheduling_policy=policy,
        admission_max_delay=admission_max_delay, admission_headroom=admission_headroom,
        preemption_mode=preemption_mode,
    )
    config = ResolvedConfig(
        asked=asked,
        device="cpu",
        dtype="float32",
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=block_size,
        num_kv_blocks=num_blocks,
        admission_batch=admission_batch,
        cuda_graphs=False,
        overlap=False,
        kernels="torch",
        attention_backend="torch",
        num_threads=None,
        swap_space=1.0 if swap else 0.0,
        num_host_blocks=num_host_blocks,
    )
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching,
                      num_host_blocks=num_host_blocks, offload=offload, cache_events=True)
    return Scheduler(config, bm, eos_token_ids={EOS}, cost=cost)


def default_token(seq: Sequence) -> int:
    """What the fake model samples: a function of the sequence and position, never EOS."""
    return 10 + (seq.seq_id * 7 + seq.num_tokens) % 50


class FakeEngine:
    """Runs schedule -> fake forward -> advance -> resolve, as the engine does, and checks
    the invariants of each step.

    The fake KV cache stores, in each slot, the token prefix whose last K/V lives there,
    so a sequence reading a slot someone else wrote (a prefix hit) is checked exactly; the
    host tier's slots hold copies of whole blocks, moved in the order the step's copies
    say (out, then in), so a block swapped or offloaded and copied back is checked too.
    """

    def __init__(self, sched: Scheduler, next_token=default_token, overlap: bool = False) -> None:
        self.sched = sched
        self.next_token = next_token
        self.overlap = overlap  # resolve each step's tokens one step later, as on a GPU
        self.inflight: tuple[list[Sequence], list[int]] | None = None
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}
        self.host: dict[int, list] = {}  # host slot -> the block's slots' contents
        self.findable: dict[str, set[int]] = {"GPU": set(), "CPU": set()}  # from cache events
        self.seqs: list[Sequence] = []
        self.finished: set[int] = set()

    def add(self, prompt: list[int], priority: int = 0, **params) -> Sequence:
        seq = Sequence(len(self.seqs), prompt, SamplingParams(**params), priority=priority)
        self.seqs.append(seq)
        self.sched.add(seq)
        return seq

    def step(self) -> list[tuple[int, int]]:
        """One engine step; returns (seq_id, num_scheduled_tokens) per batch row."""
        sched = self.sched
        before = list(sched.running)
        batch = sched.schedule()
        check_schedule(sched, batch, before)
        self.copy(batch.copies_out, batch.copies_in)
        rows = [(s.seq_id, s.num_scheduled_tokens) for s in batch.seqs]
        on_device = {}
        if self.inflight is not None:
            on_device = {s.seq_id: t for s, t in zip(*self.inflight, strict=True)}
        self._forward(batch.seqs, on_device)
        sampling = batch.sampling_seqs
        tokens = [self.next_token(s) for s in sampling]
        if not self.overlap:
            sched.advance(batch)
            for seq in sched.resolve(sampling, tokens):
                assert seq.is_finished == (seq.finish_reason is not None)
        else:
            if self.inflight is not None:
                sched.resolve(*self.inflight)
            sched.advance(batch)
            self.inflight = (sampling, tokens) if sampling else None
        self.check_after_step()
        return rows

    def copy(self, out: list[tuple[int, int]], in_: list[tuple[int, int]]) -> None:
        bs = self.sched.block_manager.block_size
        for block, slot in out:
            self.host[slot] = [self.kv.get((block, i)) for i in range(bs)]
        for slot, block in in_:
            for i, content in enumerate(self.host[slot]):
                self.kv[(block, i)] = content

    def _forward(self, seqs: list[Sequence], on_device: dict[int, int]) -> None:
        bs = self.sched.block_manager.block_size
        for seq in seqs:
            slots = [(b, i) for b in seq.block_table for i in range(bs)]
            tokens = list(seq.token_ids)
            if tokens[-1] == PLACEHOLDER:  # the model reads it from the previous step's output
                tokens[-1] = on_device[seq.seq_id]
            for p in range(seq.num_computed_tokens):  # the context it attends to
                assert self.kv.get(slots[p]) == tuple(tokens[: p + 1]), (seq, p)
            end = seq.num_computed_tokens + seq.num_scheduled_tokens
            for p in range(seq.num_computed_tokens, end):
                self.kv[slots[p]] = tuple(tokens[: p + 1])

    def check_after_step(self) -> None:
        sched = self.sched
        live = list(sched.waiting) + sched.running
        sched.block_manager.check_invariants(live)
        self.check_cache_events()
        for seq in self.seqs:
            if seq.is_finished:
                assert seq.finish_reason is not None and seq.block_table == []
                assert seq not in live
                self.finished.add(seq.seq_id)
            else:
                assert seq.finish_reason is None

    def check_cache_events(self) -> None:
        """Replaying the cache events gives exactly the hashes each tier can find."""
        bm = self.sched.block_manager
        for event in bm.take_cache_events():
            if event[0] == "stored":
                assert event[2] not in self.findable[event[1]], ("stored twice", event)
                self.findable[event[1]].add(event[2])
            elif event[0] == "removed":
                self.findable[event[1]].remove(event[2])
            else:
                self.findable = {"GPU": set(), "CPU": set()}
        assert self.findable["GPU"] == set(bm.hash_to_block)
        assert self.findable["CPU"] == set(bm.host.hash_to_block if bm.host else ())

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.sched.finish(seq, reason)
        self.check_after_step()

    def has_work(self) -> bool:
        return self.sched.has_unfinished() or self.inflight is not None

    def run(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if not self.has_work():
                return
            self.step()
        raise AssertionError("the scheduler stopped making progress")


def check_schedule(sched: Scheduler, batch, before: list[Sequence]) -> None:
    """The per-step invariants of DESIGN.md and of each policy."""
    bs = sched.block_manager.block_size
    seqs = batch.seqs
    assert len({id(s) for s in seqs}) == len(seqs) <= sched.max_num_seqs
    assert len(sched.running) <= sched.max_num_seqs
    assert batch.num_tokens <= sched.max_num_batched_tokens
    for seq in seqs:
        assert 1 <= seq.num_scheduled_tokens <= seq.num_tokens - seq.num_computed_tokens
    blocks_for = lambda n: -(-n // bs)
    for seq in sched.running:  # KV slots for every computed and scheduled token, no more
        needed = seq.num_computed_tokens + seq.num_scheduled_tokens
        assert len(seq.block_table) == blocks_for(needed)
    preempted = [s for s in before if s.status == SequenceStatus.WAITING]
    if len({s.priority for s in before}) == 1:
        assert preempted == before[len(before) - len(preempted) :], "victims come from the tail"
    survivors = [s for s in before if s.status == SequenceStatus.RUNNING]
    worst_first = all(k.priority <= v.priority for k in survivors for v in preempted)
    assert sched.policy != "fair" or worst_first, "victims come from the worst priority"
    # a sequence whose in-flight token is its last (by length) needs no step
    kept = [
        s
        for s in before
        if s.status == SequenceStatus.RUNNING and not sched._will_stop_by_length(s)
    ]
    if sched.policy == "fair":
        assert all(s in seqs for s in kept), "a running sequence did not advance"
        assert all(s.status == SequenceStatus.RUNNING for s in seqs)
    elif seqs and seqs[0] in before:  # prefill_first, a decode-only step
        assert seqs == kept and all(s.num_scheduled_tokens == 1 for s in seqs)
        assert all(not s.in_prefill for s in seqs)
    else:  # prefill_first, a prefill-only step: only the first row may be a chunk
        assert not any(s in before for s in seqs)
        for seq in seqs[1:]:
            assert seq.num_computed_tokens + seq.num_scheduled_tokens == seq.num_tokens
        for seq in seqs:  # the whole block table before the first chunk
            assert len(seq.block_table) == blocks_for(seq.num_tokens)


def prompt(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def expected_output(seq: Sequence, script: list[int], max_model_len: int):
    """The tokens and finish reason a request gets when nothing interferes."""
    sp = seq.sampling_params
    out: list[int] = []
    for token in script:
        out.append(token)
        if token == EOS or token in sp.stop_token_ids:
            return out, FinishReason.STOP
        if len(out) == sp.max_tokens or seq.num_prompt_tokens + len(out) >= max_model_len:
            return out, FinishReason.LENGTH
    raise AssertionError("script too short")
