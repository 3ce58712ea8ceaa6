"""The scheduler driven like the engine does it, with a fake model and no torch."""

import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanovllm.core.config import POLICIES
from nanovllm.core.sampling_params import SamplingParams
from nanovllm.core.scheduler import Scheduler
from nanovllm.core.sequence import FinishReason, Sequence, SequenceStatus
from tests.core.scheduler_harness import (
    EOS,
    STOP_ID,
    FakeEngine,
    expected_output,
    make_scheduler,
    prompt,
)

# ---- prefill_first ------------------------------------------------------------


def test_prefill_first_first_step_takes_first_two_prompts_whole():
    sched = make_scheduler("prefill_first", max_num_batched_tokens=16, max_num_seqs=3)
    eng = FakeEngine(sched)
    for i, n in enumerate((6, 7, 5)):
        eng.add(prompt(n, 100 * i), max_tokens=4)
    assert eng.step() == [(0, 6), (1, 7)]
    assert eng.step() == [(2, 5)]  # prefill only: the decodes wait
    for _ in range(3):
        assert sched.running == eng.seqs
        assert eng.step() == [(0, 1), (1, 1), (2, 1)]
    assert not sched.has_unfinished()
    assert all(s.num_output_tokens == 4 for s in eng.seqs)


def test_prefill_first_chunks_only_the_first_prefill_of_a_step():
    sched = make_scheduler("prefill_first", max_num_batched_tokens=8, block_size=4)
    eng = FakeEngine(sched)
    a = eng.add(prompt(3), max_tokens=2)
    b = eng.add(prompt(10, 200), max_tokens=2)
    assert eng.step() == [(0, 3)]  # b would need a chunk, but it is not first
    assert eng.step() == [(1, 8)]  # now first: chunked, and a's decode waits
    assert len(b.block_table) == 3 and b.status == SequenceStatus.WAITING
    assert eng.step() == [(1, 2)]
    assert eng.step() == [(0, 1), (1, 1)]
    assert a.is_finished and b.is_finished


def test_prefill_first_admits_a_prompt_that_exactly_fills_the_remaining_budget():
    """A second prompt is taken whole when its tokens equal what is left of the budget."""
    sched = make_scheduler("prefill_first", max_num_batched_tokens=16)
    eng = FakeEngine(sched)
    eng.add(prompt(6), max_tokens=2)
    eng.add(prompt(10, 200), max_tokens=2)
    assert eng.step() == [(0, 6), (1, 10)]


# ---- fair ---------------------------------------------------------------------


def test_fair_decodes_first_and_allocates_prompts_chunk_by_chunk():
    sched = make_scheduler("fair", max_num_batched_tokens=8, block_size=4)
    eng = FakeEngine(sched)
    a = eng.add(prompt(3), max_tokens=5)
    b = eng.add(prompt(20, 200), max_tokens=2)
    assert eng.step() == [(0, 3), (1, 5)]
    assert len(b.block_table) == 2  # 5 tokens, not the 5 blocks of the whole prompt
    c = eng.add(prompt(6, 300), max_tokens=1)
    assert eng.step() == [(0, 1), (1, 7)]
    assert len(b.block_table) == 3
    assert eng.step() == [(0, 1), (1, 7)]
    assert eng.step() == [(0, 1), (1, 1), (2, 6)]
    eng.run()
    assert [s.num_output_tokens for s in (a, b, c)] == [5, 2, 1]


@pytest.mark.parametrize("policy", POLICIES)
def test_fair_advances_every_running_sequence_while_prompts_arrive(policy):
    rng = random.Random(0)
    sched = make_scheduler(policy, num_blocks=256, max_num_seqs=8, max_num_batched_tokens=16)
    eng = FakeEngine(sched)
    stalled = 0
    for _ in range(60):
        eng.add(prompt(rng.randint(1, 30)), max_tokens=rng.randint(1, 10))
        before = list(sched.running)
        rows = dict(eng.step())
        stalled += sum(s.seq_id not in rows for s in before)
    eng.run()
    assert sched.num_preemptions == 0
    if policy == "fair":
        assert stalled == 0
    else:
        assert stalled > 0  # the seed's policy stalls every decode for each new prompt


@pytest.mark.parametrize("policy", POLICIES)
def test_prompts_sharing_a_prefix_reuse_its_blocks(policy):
    sched = make_scheduler(policy, block_size=4)
    eng = FakeEngine(sched)
    a = eng.add(prompt(10), max_tokens=4)
    eng.step()
    b = eng.add(prompt(8) + [1, 2, 3], max_tokens=2)  # shares two full blocks with a
    eng.step()
    assert b.num_cached_prefix_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert [sched.block_manager.blocks[i].ref_count for i in b.block_table[:2]] == [2, 2]
    eng.run()
    c = eng.add(prompt(10), max_tokens=2)  # after both finished, the blocks are still cached
    eng.run()
    assert c.num_cached_prefix_tokens == 8
    assert (sched.prefix_hits, sched.prefix_queries) == (16, 10 + 11 + 10)


@pytest.mark.parametrize(
    "num_blocks, first, steps",
    [
        # 1 block free: the prompt's next chunk shrinks from 7 to the 6 tokens that fit
        (4, 2, [[(0, 2), (1, 6)], [(0, 1), (1, 6)]]),
        # no block free, 1 slot left in its last block: a 1-token chunk
        (3, 1, [[(0, 1), (1, 7)], [(0, 1), (1, 1)]]),
    ],
)
def test_fair_running_prompt_short_of_blocks_takes_the_chunk_that_fits(num_blocks, first, steps):
    """A running prompt whose next chunk needs more blocks than are free gets the largest
    chunk its blocks and the free ones hold (even one token) instead of being preempted."""
    max_len = num_blocks * 4  # the cache holds one whole sequence, as the engine ensures
    sched = make_scheduler("fair", num_blocks=num_blocks, block_size=4, max_num_seqs=2,
                           max_num_batched_tokens=8, max_model_len=max_len)
    eng = FakeEngine(sched)
    eng.add(prompt(first), max_tokens=3)
    eng.add(prompt(max_len - 1, 200), max_tokens=1)
    assert [eng.step() for _ in steps] == steps
    assert sched.num_preemptions == 0
    eng.run()


def test_fair_preempting_a_scheduled_decode_gives_its_token_back_to_the_budget():
    """A decode dropped from the step by KV preemption returns its token to the budget,
    so a prompt chunk later in the same step can use it."""
    sched = make_scheduler("fair", num_blocks=5, block_size=4, max_num_seqs=3,
                           max_num_batched_tokens=8, max_model_len=20)
    eng = FakeEngine(sched)
    low = eng.add(prompt(8, 500), 1, max_tokens=8)
    assert eng.step() == [(0, 8)]
    d = eng.add(prompt(4), 0, max_tokens=8)
    p = eng.add(prompt(12, 300), 0, max_tokens=2)
    assert eng.step() == [(0, 1), (1, 4), (2, 3)]  # every block is in use now
    # low decodes first, then d needs a block: low (the worst priority) is preempted, its
    # token goes back to the budget, and p's chunk takes all 8 - 1 that is left
    assert eng.step() == [(d.seq_id, 1), (p.seq_id, 7)]
    assert list(sched.waiting) == [low] and low.num_preemptions == 1
    eng.run()


def test_fair_step_that_preempts_for_blocks_admits_no_new_prompt():
    """After a running sequence is preempted for KV blocks, the step admits nothing, even
    a waiting prompt the freed blocks would hold; it starts on the next step."""
    sched = make_scheduler("fair", num_blocks=3, block_size=4, max_num_seqs=3,
                           max_model_len=12)
    eng = FakeEngine(sched)
    a = eng.add(prompt(4), 0, max_tokens=4)
    low = eng.add(prompt(5, 200), 1, max_tokens=4)
    assert eng.step() == [(0, 4), (1, 5)]  # all three blocks in use
    new = eng.add(prompt(2, 300), 0, max_tokens=1)
    assert eng.step() == [(a.seq_id, 1)]  # a's new block came from preempting low
    assert low.num_preemptions == 1 and list(sched.waiting) == [new, low]
    assert eng.step() == [(a.seq_id, 1), (new.seq_id, 2)]
    eng.run()


# ---- preemption, finishing ------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_preemption_recomputes_the_tail_and_keeps_every_token(policy):
    def run(num_blocks: int) -> tuple[Scheduler, list[Sequence]]:
        sched = make_scheduler(policy, num_blocks=num_blocks, max_model_len=24)
        eng = FakeEngine(sched)
        seqs = [eng.add(prompt(8, 100 * i), max_tokens=10) for i in range(3)]
        eng.run()
        return sched, seqs

    roomy, expected = run(num_blocks=64)
    tight, seqs = run(num_blocks=6)  # one 24-token sequence fits, three do not
    assert roomy.num_preemptions == 0
    assert tight.num_preemptions > 0
    assert sum(s.num_preemptions for s in seqs) == tight.num_preemptions
    assert seqs[0].num_preemptions == 0  # the head of `running` is never the victim
    for got, want in zip(seqs, expected, strict=True):
        assert got.finish_reason == want.finish_reason == FinishReason.LENGTH
        assert got.token_ids == want.token_ids and got.num_output_tokens == 10
    assert tight.block_manager.num_free_blocks == 6


@pytest.mark.parametrize("policy", POLICIES)
def test_finishing_a_sequence_mid_prefill_frees_its_blocks(policy):
    sched = make_scheduler(policy, max_num_batched_tokens=8, block_size=4)
    eng = FakeEngine(sched)
    seq = eng.add(prompt(20), max_tokens=3)
    assert eng.step() == [(0, 8)]
    assert seq.in_prefill and seq.block_table
    eng.finish(seq, FinishReason.ABORT)
    assert seq.block_table == [] and seq.finish_reason == FinishReason.ABORT
    assert not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    eng.finish(seq, FinishReason.STOP)  # a second finish changes nothing
    assert seq.finish_reason == FinishReason.ABORT


def test_a_new_sequence_has_done_nothing_yet():
    """A request's outputs before (or without) admission, and streamed ones before its end,
    report a sequence's initial state: waiting, nothing computed, scheduled or cached,
    no finish or stop reason, no queue time yet."""
    seq = Sequence(0, prompt(5), SamplingParams())
    assert seq.status == SequenceStatus.WAITING and not seq.is_finished
    assert (seq.num_computed_tokens, seq.num_scheduled_tokens) == (0, 0)
    assert (seq.num_cached_prefix_tokens, seq.num_preemptions) == (0, 0)
    assert (seq.finish_reason, seq.stop_reason, seq.first_scheduled_time) == (None, None, None)
    assert seq.output_token_ids == [] and seq.logprobs == [] and seq.block_table == []


def test_waiting_and_running_sequences_can_be_aborted():
    sched = make_scheduler(max_num_seqs=1)
    eng = FakeEngine(sched)
    a = eng.add(prompt(5), max_tokens=8)
    b = eng.add(prompt(5, 200), max_tokens=8)
    eng.step()
    assert sched.running == [a] and list(sched.waiting) == [b]
    assert a.stop_reason is None  # running, not stopped
    assert sched.schedule().seqs == [a] and a.num_scheduled_tokens == 1  # a's next step
    eng.finish(b, FinishReason.ABORT)
    eng.finish(a, FinishReason.TIMEOUT)
    assert (a.finish_reason, b.finish_reason) == (FinishReason.TIMEOUT, FinishReason.ABORT)
    assert a.num_scheduled_tokens == 0  # ended while scheduled: nothing left to run
    # b never ran: its output reports no cached tokens and no queue time
    assert (b.num_cached_prefix_tokens, b.first_scheduled_time) == (0, None)
    assert not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_stop_conditions():
    script = {0: [7, EOS], 1: [7, EOS, 9], 2: [7, STOP_ID], 3: [7, 7, 7], 4: [EOS, 7, EOS],
              5: [7, EOS, 7, 7], 6: [7, STOP_ID, 7, 7]}

    def next_token(seq: Sequence) -> int:
        return script[seq.seq_id][seq.num_output_tokens]

    sched = make_scheduler(max_model_len=12)
    eng = FakeEngine(sched, next_token)
    eos = eng.add(prompt(4), ignore_eos=False)
    ignore = eng.add(prompt(4), ignore_eos=True, max_tokens=3)
    stop = eng.add(prompt(4), stop_token_ids=[STOP_ID])
    long = eng.add(prompt(10), max_tokens=None)
    min_tokens = eng.add(prompt(4), ignore_eos=False, min_tokens=2)
    # a stop token is honoured from the min_tokens-th output token on, that one included
    eos_at_min = eng.add(prompt(4), ignore_eos=False, min_tokens=2)
    stop_at_min = eng.add(prompt(4), stop_token_ids=[STOP_ID], min_tokens=2)
    eng.run()
    assert (eos.finish_reason, eos.output_token_ids) == (FinishReason.STOP, [7, EOS])
    assert (ignore.finish_reason, ignore.output_token_ids) == (FinishReason.LENGTH, [7, EOS, 9])
    assert (stop.finish_reason, stop.stop_reason) == (FinishReason.STOP, STOP_ID)
    assert (long.finish_reason, long.num_tokens) == (FinishReason.LENGTH, 12)  # max_model_len
    assert min_tokens.output_token_ids == [EOS, 7, EOS]
    assert (eos_at_min.finish_reason, eos_at_min.output_token_ids) == (FinishReason.STOP, [7, EOS])
    assert (stop_at_min.stop_reason, stop_at_min.output_token_ids) == (STOP_ID, [7, STOP_ID])
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


# ---- every mix of requests --------------------------------------------------------


# HYPOTHESIS_EXAMPLES=10000 for a deeper search than CI's
@settings(max_examples=int(os.environ.get("HYPOTHESIS_EXAMPLES", 1000)), deadline=None,
          database=None)
@given(st.data())
def test_random_mix_of_requests_returns_every_block(data):
    policy = data.draw(st.sampled_from(POLICIES), label="policy")
    block_size = data.draw(st.sampled_from([1, 2, 4, 8]), label="block_size")
    max_len = data.draw(st.integers(4, 40), label="max_model_len")
    max_num_seqs = data.draw(st.integers(1, 6), label="max_num_seqs")
    budget = data.draw(st.integers(max_num_seqs, 40), label="max_num_batched_tokens")
    per_seq = -(-max_len // block_size)
    num_blocks = data.draw(st.integers(per_seq, 2 * per_seq), label="num_blocks")
    prefix_caching = data.draw(st.booleans(), label="prefix caching")
    overlap = data.draw(st.booleans(), label="overlap")
    priorities = data.draw(st.booleans(), label="priorities")
    admission_batch = data.draw(st.integers(1, max_num_seqs), label="admission_batch")
    admission_delay = data.draw(st.integers(0, 3), label="admission_max_delay")
    headroom = data.draw(st.integers(0, 4), label="admission_headroom")
    tier = data.draw(st.sampled_from(["none", "swap", "offload", "both"]), label="host tier")
    if not prefix_caching:
        tier = "none"
    host_blocks = 0 if tier == "none" else data.draw(st.integers(1, 2 * per_seq), label="host")
    lengths = st.integers(1, max_len - 1)
    requests = data.draw(
        st.lists(  # (steps after the previous arrival, prompt length, shared prefix, max_tokens)
            st.tuples(st.integers(0, 2), lengths, st.integers(0, max_len), st.integers(1, max_len)),
            min_size=1,
            max_size=12,
        ),
        label="requests",
    )
    rng = random.Random(data.draw(st.integers(0, 2**32), label="seed"))  # token values

    sched = make_scheduler(
        policy,
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_len,
        prefix_caching=prefix_caching,
        admission_batch=admission_batch,
        admission_max_delay=admission_delay,
        admission_headroom=headroom,
        num_host_blocks=host_blocks,
        swap=tier in ("swap", "both"),
        offload=tier in ("offload", "both"),
    )
    scripts: dict[int, list[int]] = {}  # what the fake model samples, per request
    eng = FakeEngine(sched, lambda seq: scripts[seq.seq_id][seq.num_output_tokens], overlap)
    bases = [[rng.randrange(20) for _ in range(max_len)] for _ in range(2)]
    aborted: set[int] = set()
    arrival_step = 0
    pending = list(requests)

    for step in range(2000):
        while pending and arrival_step + pending[0][0] <= step:
            gap, length, shared, max_tokens = pending.pop(0)
            arrival_step += gap
            shared = min(shared, length)  # a shared prefix exercises the cache
            tail = [rng.randrange(20) for _ in range(length - shared)]
            tokens = rng.choice(bases)[:shared] + tail
            script = [rng.choice((EOS, STOP_ID) + (7,) * 30) for _ in range(max_len)]
            scripts[len(eng.seqs)] = script
            stop_ids = [STOP_ID] if rng.random() < 0.5 else None
            priority = rng.choice((0, 1, 2)) if priorities else 0
            eng.add(tokens, priority, max_tokens=max_tokens, ignore_eos=False,
                    stop_token_ids=stop_ids)
        keys = [s.priority for s in sched.waiting]
        assert keys == sorted(keys), "waiting must stay ordered by priority"
        live = list(sched.waiting) + sched.running
        if live and data.draw(st.integers(0, 11), label="abort?") == 0:
            mid_prefill = [s for s in live if s.in_prefill and s.block_table]
            pool = mid_prefill if mid_prefill and data.draw(st.booleans()) else live
            victim = data.draw(st.sampled_from(pool), label="victim")
            eng.finish(victim, FinishReason.ABORT)
            aborted.add(victim.seq_id)
        if not pending and not eng.has_work():
            break
        eng.step()
    else:
        raise AssertionError("the scheduler stopped making progress")

    assert eng.finished == {s.seq_id for s in eng.seqs}
    for seq in eng.seqs:
        out, reason = expected_output(seq, scripts[seq.seq_id], max_len)
        if seq.seq_id in aborted:
            assert seq.finish_reason == FinishReason.ABORT
            assert out[: seq.num_output_tokens] == seq.output_token_ids
        else:  # preemption and prefix hits change nothing
            assert (seq.output_token_ids, seq.finish_reason) == (out, reason)
    bm = sched.block_manager
    eng.copy(*bm.take_copies())  # an empty last step leaves its copies for the next one
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_blocks
    if bm.host:
        assert len(bm.host.free) == bm.host.num_blocks, "a host block leaked"


def test_resolve_stores_logprobs_of_the_rows_that_have_them():
    """`resolve` puts each row's sampled token in place, appends logprobs only for rows
    given some, and refuses a token list of another length than the rows."""
    sched = make_scheduler()
    a, b = (Sequence(i, prompt(3, 100 * i), SamplingParams()) for i in range(2))
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert batch and batch.sampling_seqs == [a, b]
    sched.advance(batch)
    assert sched.resolve([a, b], [7, 8], [{7: -0.5}, None]) == [a, b]
    assert (a.output_token_ids, b.output_token_ids) == ([7], [8])
    assert (a.logprobs, b.logprobs) == ([{7: -0.5}], [])
    batch = sched.schedule()
    sched.advance(batch)
    with pytest.raises(ValueError):
        sched.resolve(batch.sampling_seqs, [9])
    sched.finish(a, FinishReason.ABORT)
    sched.finish(b, FinishReason.ABORT)
    assert not sched.schedule()  # nothing left: an empty batch
