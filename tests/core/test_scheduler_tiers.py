"""The scheduler's side of the KV tiers, with a fake model: which victims swap and which
recompute (mode and cost), what each step reports as preempted, and admission headroom."""

from dataclasses import replace

import pytest

from nanovllm.core.host_tier import PreemptionCost
from nanovllm.core.sequence import SequenceStatus
from tests.core.scheduler_harness import FakeEngine, make_scheduler, prompt

BS = 4


def cost(copy_bytes_per_s: float) -> PreemptionCost:
    """A block of 1 byte and one FLOP a token at BS FLOP/s: a block recomputes in exactly
    1 s, and swaps (out and back) in 2 / copy_bytes_per_s s."""
    return PreemptionCost(block_bytes=1, copy_bytes_per_s=copy_bytes_per_s,
                          flops_per_token=1.0, attention_flops=0.0, flops_per_s=BS)


def test_cost_model_arithmetic():
    c = PreemptionCost(block_bytes=10, copy_bytes_per_s=5.0, flops_per_token=2.0,
                       attention_flops=0.5, flops_per_s=4.0)
    assert c.swap_seconds(3) == 2 * 3 * 10 / 5.0
    # the copy out hidden behind the forward pass: only the copy back is paid
    assert replace(c, out_hidden=True).swap_seconds(3) == 3 * 10 / 5.0
    assert c.recompute_seconds(4) == (2.0 * 4 + 0.5 * 16) / 4.0


def preempt_one(**options):
    """Two 8-token prompts on 5 blocks of 4: the second is preempted when the first needs
    its third block. Returns (scheduler, victim, preempted list of that step)."""
    sched = make_scheduler("fair", num_blocks=5, block_size=BS, max_num_seqs=2,
                           max_model_len=20, num_host_blocks=8, **options)
    eng = FakeEngine(sched)
    first = eng.add(prompt(8), max_tokens=6)
    victim = eng.add(prompt(8, 300), max_tokens=6)
    for _ in range(8):
        eng.step()
        if sched.num_preemptions:
            break
    assert victim.status == SequenceStatus.WAITING and first.status == SequenceStatus.RUNNING
    return sched, victim, list(sched.preempted), eng


@pytest.mark.parametrize("options, kind", [
    (dict(swap=False), "recompute"),
    (dict(swap=True, preemption_mode="recompute"), "recompute"),
    (dict(swap=True, preemption_mode="swap", cost=cost(1e-9)), "swap"),  # swap, whatever it costs
    (dict(swap=True), "swap"),  # auto without a measured cost: swap
    (dict(swap=True, cost=cost(2.0001)), "swap"),  # copying is a hair cheaper
    (dict(swap=True, cost=cost(2.0)), "recompute"),  # a tie recomputes
    (dict(swap=True, cost=cost(1.0)), "recompute"),
])
def test_each_victim_swaps_or_recomputes_by_mode_and_cost(options, kind):
    sched, victim, preempted, eng = preempt_one(**options)
    assert preempted == [(victim, kind)]
    swapped = kind == "swap"
    assert sched.num_swaps == (1 if swapped else 0) and sched.num_preemptions == 1
    assert len(victim.host_blocks) == (2 if swapped else 0)  # its two full blocks
    assert sched.block_manager.events["swapped_out"] == (2 if swapped else 0)
    eng.step()
    assert sched.preempted == []  # a step reports only its own preemptions
    eng.run()
    assert victim.host_blocks == [] and victim.num_output_tokens == 6


def test_a_victim_without_a_full_block_recomputes():
    sched = make_scheduler("fair", num_blocks=2, block_size=BS, max_num_seqs=2,
                           max_model_len=8, num_host_blocks=8, swap=True)
    eng = FakeEngine(sched)
    eng.add(prompt(3), max_tokens=4)
    victim = eng.add(prompt(2, 300), max_tokens=4)
    while not sched.num_preemptions:
        eng.step()
    assert victim.block_hashes == [] and sched.num_swaps == 0
    eng.run()


# ---- admission headroom --------------------------------------------------------------


def headroom_case(free_after: int, headroom: int = 2, priority: int = 1,
                  sized_for: int | None = None):
    """Is a waiting 5-token prompt admitted beside one running sequence (priority 1, 6
    tokens, 5 computed, one decoding)? On blocks of 4 the runner needs ceil((6 + headroom)
    / 4) blocks in all and the prompt ceil((5 + headroom) / 4); the cache has `free_after`
    blocks more than that (sized for `sized_for` tokens of headroom, if given)."""
    h = headroom if sized_for is None else sized_for
    running_need = -(-(6 + h) // BS)
    waiting_need = -(-(5 + h) // BS)
    num_blocks = running_need + waiting_need + free_after
    sched = make_scheduler("fair", num_blocks=num_blocks, block_size=BS, max_num_seqs=4,
                           max_model_len=64, admission_headroom=headroom)
    eng = FakeEngine(sched)
    runner = eng.add(prompt(4), 1, max_tokens=30)
    eng.step()  # its prompt
    eng.step()  # a decode: 5 tokens, 2 blocks
    assert runner.num_tokens == 6 and len(runner.block_table) == 2
    new = eng.add(prompt(5, 300), priority, max_tokens=2)
    eng.step()
    return new.status == SequenceStatus.RUNNING


def test_headroom_admits_exactly_when_prompt_and_running_growth_fit():
    assert headroom_case(free_after=0) is True  # exactly enough: admitted
    assert headroom_case(free_after=-1) is False  # one block short: it waits


@pytest.mark.parametrize("headroom", [1, 2, 5, 9])
def test_headroom_counts_its_tokens_for_the_prompt_and_each_running_sequence(headroom):
    assert headroom_case(0, headroom) is True
    assert headroom_case(-1, headroom) is False


def test_a_prompt_that_outranks_running_work_is_not_held_by_headroom():
    assert headroom_case(free_after=-1, priority=2) is False  # worse: held
    assert headroom_case(free_after=-1, priority=0) is True  # better than the runner's 1


def test_headroom_zero_admits_whenever_the_prompt_fits():
    assert headroom_case(free_after=0, headroom=0) is True
    assert headroom_case(free_after=0, headroom=3, sized_for=0) is False


def test_every_swap_is_counted_and_every_victim_resumes():
    sched = make_scheduler("fair", num_blocks=6, block_size=BS, max_num_seqs=3,
                           max_model_len=24, num_host_blocks=16, swap=True)
    eng = FakeEngine(sched)
    seqs = [eng.add(prompt(8, 100 * i), max_tokens=10) for i in range(3)]
    kinds = []
    while eng.has_work():
        eng.step()
        kinds += [k for _, k in sched.preempted]
    assert len(kinds) >= 2 and set(kinds) == {"swap"}
    assert sched.num_swaps == sched.num_preemptions == len(kinds)
    assert all(s.num_output_tokens == 10 and s.host_blocks == [] for s in seqs)
    assert sched.block_manager.events["swapped_in"] > 0


@pytest.mark.parametrize("spare, admitted", [(0, True), (-1, False)])
def test_headroom_counts_only_what_a_prompt_still_lacks_after_its_prefix_hit(spare, admitted):
    """A prompt whose first 8 tokens are cached needs room for its 1 new token (+ the
    headroom), not for all 9."""
    h = 2
    runner_blocks = -(-(10 + h) // BS)  # 8-token prompt, 2 tokens out, 1 decoding
    new_blocks = -(-(9 + h) // BS) - 2  # beyond the 2 cached blocks it shares
    sched = make_scheduler("fair", num_blocks=runner_blocks + new_blocks + spare,
                           block_size=BS, max_num_seqs=4, max_model_len=64,
                           admission_headroom=h)
    eng = FakeEngine(sched)
    runner = eng.add(prompt(8), 1, max_tokens=30)
    eng.step()
    eng.step()
    assert runner.num_tokens == 10
    new = eng.add(prompt(8) + [999], 1, max_tokens=2)
    eng.step()
    assert (new.status == SequenceStatus.RUNNING) is admitted
    if admitted:
        assert new.num_cached_prefix_tokens == 8
