"""Priorities and admission batching: waiting order, preemption of worse running requests
(and where the preempted ones queue), prompts held for a batch of free rows."""

from nanovllm.core.sequence import FinishReason, SequenceStatus
from tests.core.scheduler_harness import FakeEngine, expected_output, make_scheduler, prompt


def test_admission_batch_admits_prompts_together_once_rows_are_free():
    sched = make_scheduler("fair", max_num_seqs=4, max_num_batched_tokens=32,
                           admission_batch=2, admission_max_delay=100)
    eng = FakeEngine(sched)
    for n in (2, 4, 30, 30):  # a ends first, b two steps later, c and d keep running
        eng.add(prompt(3), max_tokens=n)
    e, f = eng.add(prompt(3, 300), max_tokens=1), eng.add(prompt(3, 400), max_tokens=1)
    assert eng.step() == [(0, 3), (1, 3), (2, 3), (3, 3)]
    assert eng.step() == [(0, 1), (1, 1), (2, 1), (3, 1)]  # a's last token
    # one row free: e and f wait (decode-only steps) until b's end frees a second one
    assert eng.step() == [(1, 1), (2, 1), (3, 1)]
    assert eng.step() == [(1, 1), (2, 1), (3, 1)]  # b's last token
    assert eng.step() == [(2, 1), (3, 1), (e.seq_id, 3), (f.seq_id, 3)]
    eng.run()


def test_admission_batch_holds_a_prompt_at_most_max_delay_steps():
    sched = make_scheduler("fair", max_num_seqs=4, max_num_batched_tokens=32,
                           admission_batch=3, admission_max_delay=2)
    eng = FakeEngine(sched)
    for n in (2, 40, 40, 40):
        eng.add(prompt(3), max_tokens=n)
    late = [eng.add(prompt(3, 300 + 50 * i), max_tokens=1) for i in range(3)]
    eng.step()  # prefill
    eng.step()  # a's last token
    steps = [eng.step() for _ in range(3)]
    assert [len(r) for r in steps] == [3, 3, 4]  # held twice, then the one free row is used
    assert steps[2][-1] == (late[0].seq_id, 3)
    eng.run()


def test_priority_orders_waiting_and_preempts_worse_running():
    sched = make_scheduler("fair", num_blocks=64, block_size=4, max_num_seqs=2,
                           max_num_batched_tokens=64, max_model_len=40)
    eng = FakeEngine(sched)
    low = [eng.add([1, 2, 3], 5, max_tokens=20), eng.add([4, 5, 6], 5, max_tokens=20)]
    eng.step()
    assert {s.seq_id for s in sched.running} == {s.seq_id for s in low}
    mid = eng.add([7, 8], 1, max_tokens=3)
    urgent = eng.add([9, 9], 0, max_tokens=3)
    assert [s.seq_id for s in sched.waiting] == [urgent.seq_id, mid.seq_id]
    rows = dict(eng.step())
    # both rows were taken by the better priorities; the newest low one went first
    assert urgent.seq_id in rows and mid.seq_id in rows
    assert low[0].num_preemptions == 1 and low[1].num_preemptions == 1
    assert [s.priority for s in sched.waiting] == [5, 5]
    while eng.has_work():
        eng.step()
    for seq in low + [mid, urgent]:  # preemption lost nothing
        script = [10 + (seq.seq_id * 7 + seq.num_prompt_tokens + k) % 50 for k in range(40)]
        assert seq.output_token_ids == expected_output(seq, script, 40)[0]


def test_waiting_is_ordered_by_priority_then_arrival():
    """New requests queue behind every request of their priority or better, ahead of
    worse ones: lower priority values first, first come first served within one."""
    sched = make_scheduler(max_num_seqs=1)
    eng = FakeEngine(sched)
    priorities = [1, 0, 2, 1, 0, 2, 1, 0]
    seqs = [eng.add(prompt(3, 100 * i), p) for i, p in enumerate(priorities)]
    assert list(sched.waiting) == sorted(seqs, key=lambda s: s.priority)  # a stable sort
    assert eng.step() == [(1, 3)]  # the earliest of the best priority runs first


def test_preempted_sequences_return_to_the_head_of_their_priority_in_running_order():
    """A sequence preempted for a better-priority request goes back ahead of the waiting
    requests of its own priority (behind better ones), victims keep their running order,
    and each preemption is counted; its first scheduling time is kept for queue metrics."""
    sched = make_scheduler("fair", max_num_seqs=2, max_num_batched_tokens=16)
    eng = FakeEngine(sched)
    low1, low2 = eng.add(prompt(3), 1, max_tokens=20), eng.add(prompt(3, 200), 1, max_tokens=20)
    assert eng.step() == [(0, 3), (1, 3)]
    first_scheduled = low1.first_scheduled_time
    assert first_scheduled is not None
    same = eng.add(prompt(3, 300), 1, max_tokens=1)  # no row free, and no worse victim
    assert eng.step() == [(0, 1), (1, 1)]
    assert list(sched.waiting) == [same]

    urgent = [eng.add(prompt(2, 400 + 100 * i), 0, max_tokens=1) for i in range(2)]
    assert eng.step() == [(s.seq_id, 2) for s in urgent]  # both rows taken from low1, low2
    assert list(sched.waiting) == [low1, low2, same]
    for seq in (low1, low2):
        assert seq.status == SequenceStatus.WAITING and seq.num_scheduled_tokens == 0
        assert seq.num_preemptions == 1 and seq.block_table == []

    # back in their order; each recomputes only the token after its cached first block
    assert eng.step() == [(low1.seq_id, 1), (low2.seq_id, 1)]
    assert low1.first_scheduled_time == first_scheduled
    assert list(sched.waiting) == [same]

    again = eng.add(prompt(2, 600), 0, max_tokens=1)
    assert eng.step() == [(low1.seq_id, 1), (again.seq_id, 2)]
    assert (low1.num_preemptions, low2.num_preemptions, sched.num_preemptions) == (1, 2, 3)
    assert list(sched.waiting) == [low2, same]
    eng.run()
    assert all(s.finish_reason == FinishReason.LENGTH for s in eng.seqs)


def test_fair_better_priority_prompt_short_of_blocks_preempts_and_runs_in_the_same_step():
    """A waiting request that finds no free KV blocks preempts a running request of worse
    priority and starts in that same step, with the whole token budget."""
    sched = make_scheduler("fair", num_blocks=3, block_size=4, max_num_seqs=4,
                           max_num_batched_tokens=16, max_model_len=12)
    eng = FakeEngine(sched)
    low = eng.add(prompt(8), 1, max_tokens=3)
    assert eng.step() == [(0, 8)]
    urgent = eng.add(prompt(8, 200), 0, max_tokens=1)
    assert eng.step() == [(urgent.seq_id, 8)]  # low's decode took the last block first
    assert list(sched.waiting) == [low] and low.num_preemptions == 1
    eng.run()


def test_fair_priority_preemption_waits_for_a_prompt_left_mid_prefill():
    """No priority preemption admits a request beside a prompt that this step leaves
    mid-prefill (here for lack of blocks): what a victim would free goes to that prompt."""
    sched = make_scheduler("fair", num_blocks=6, block_size=4, max_num_seqs=3,
                           max_num_batched_tokens=16, max_model_len=24)
    eng = FakeEngine(sched)
    worst = eng.add(prompt(4), 2, max_tokens=20)
    assert eng.step() == [(0, 4)]
    long = eng.add(prompt(20, 200), 0, max_tokens=2)
    assert eng.step() == [(0, 1), (1, 15)]  # every block in use
    mid = eng.add(prompt(2, 300), 1, max_tokens=2)
    # long's last free slot takes a 1-token chunk; mid finds no block, and may not take
    # worst's while long is mid-prefill
    assert eng.step() == [(0, 1), (1, 1)]
    assert list(sched.waiting) == [mid] and worst.num_preemptions == 0
    assert eng.step() == [(long.seq_id, 4)]  # worst's blocks go to long's last chunk
    assert worst.num_preemptions == 1 and list(sched.waiting) == [mid, worst]
    eng.run()


def test_admission_batch_does_not_hold_a_prompt_that_outranks_a_running_one():
    """Admission batching never holds back a waiting head of better priority than some
    running request, even when the requests behind it would be held."""
    sched = make_scheduler("fair", max_num_seqs=3, max_num_batched_tokens=16,
                           admission_batch=2, admission_max_delay=100)
    eng = FakeEngine(sched)
    for i in range(2):
        eng.add(prompt(3, 100 * i), 1, max_tokens=20)
    assert eng.step() == [(0, 3), (1, 3)]
    urgent = eng.add(prompt(3, 300), 0, max_tokens=1)
    eng.add(prompt(3, 400), 1, max_tokens=1)  # one row free, two waiting: would be held
    assert eng.step() == [(0, 1), (1, 1), (urgent.seq_id, 3)]
    eng.run()
