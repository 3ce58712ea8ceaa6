"""The host tier's books without a model: which blocks are copied where, in which step,
and which slots are held, found, evicted and released (the fuzz in test_scheduler.py checks
that whatever happens the contents stay right; these check that the tier is used)."""

import pytest

from nanovllm.core.block_manager import BlockManager, hash_block
from tests.core.test_block_manager import compute, make_seq, prefill

BS = 2


def tiered(num_blocks: int = 4, host: int = 4, offload: bool = True) -> BlockManager:
    return BlockManager(num_blocks, BS, num_host_blocks=host, offload=offload)


def run_and_free(bm: BlockManager, seq_id: int, tokens: list[int]):
    seq = make_seq(seq_id, tokens)
    hit = prefill(bm, seq)
    bm.count_hits(seq)
    bm.free(seq)
    return seq, hit


def test_an_evicted_prefix_is_copied_out_then_found_and_copied_back():
    bm = tiered()
    a = [1, 2, 3, 4, 5]  # two full blocks and one token
    run_and_free(bm, 0, a)
    assert bm.take_copies() == ([], [])  # nothing left the device yet
    run_and_free(bm, 1, [9, 8, 7, 6, 5, 4, 3, 2])  # takes all four device blocks
    out, in_ = bm.take_copies()
    assert in_ == [] and len(out) == 2 and bm.events["offloaded"] == 2
    evicted = [d for d, _ in out]
    assert sorted(evicted) == sorted(set(evicted)) and len(set(evicted)) == 2
    slots = [s for _, s in out]
    assert bm.host.usage() == {"used": 0, "cached": 2, "free": 2}

    again = make_seq(2, a)
    assert bm.allocate_cached_prefix(again) == 4  # both full blocks, from the host
    assert again.num_host_prefix_blocks == 2
    out, in_ = bm.take_copies()
    assert sorted(s for s, _ in in_) == sorted(slots)
    assert [d for _, d in in_] == again.block_table
    assert all(bm.host.blocks[s].hash == bm.blocks[d].hash for s, d in in_)
    bm.count_hits(again)
    assert bm.events["hit_host"] == 2 and bm.events["hit_device"] == 0
    # the copied-back blocks are device blocks of the prefix cache again
    assert [bm.blocks[b].hash for b in again.block_table] == [
        hash_block(a[:2], 0), hash_block(a[2:4], hash_block(a[:2], 0))]
    assert again.block_hashes == [bm.blocks[b].hash for b in again.block_table]
    bm.check_invariants([again])
    bm.free(again)
    bm.check_invariants([])


def test_a_slot_a_pending_copy_reads_is_held_until_the_step_takes_its_copies():
    bm = tiered(host=4)
    a = [1, 2, 3, 4, 5]
    run_and_free(bm, 0, a)
    run_and_free(bm, 1, [9, 8, 7, 6, 5, 4, 3, 2])
    bm.take_copies()
    again = make_seq(2, a)
    bm.allocate_cached_prefix(again)
    # read by this step's copies: not evictable (the device blocks they go to were B's,
    # offloaded into the two other slots)
    assert bm.host.usage() == {"used": 2, "cached": 2, "free": 0}
    bm.check_invariants([again])
    bm.take_copies()
    assert bm.host.usage() == {"used": 0, "cached": 4, "free": 0}
    bm.free(again)
    bm.check_invariants([])


def test_a_block_already_on_the_host_is_not_copied_again():
    bm = tiered()
    a = [1, 2, 3, 4, 5]
    run_and_free(bm, 0, a)
    run_and_free(bm, 1, [9, 8, 7, 6, 5, 4, 3, 2])
    bm.take_copies()
    _, hit = run_and_free(bm, 2, a)  # back from the host, then evicted once more
    assert hit == 4
    bm.take_copies()
    before = bm.events["offloaded"]
    run_and_free(bm, 3, [19, 18, 17, 16, 15, 14, 13, 12])
    out, _ = bm.take_copies()
    h0 = hash_block(a[:2], 0)
    copied = {bm.host.blocks[s].hash for _, s in out}
    assert out and not copied & {h0, hash_block(a[2:4], h0)}
    assert bm.events["offloaded"] - before == len(out)


def test_without_offload_nothing_leaves_the_device():
    bm = tiered(offload=False)
    run_and_free(bm, 0, [1, 2, 3, 4, 5])
    run_and_free(bm, 1, [9, 8, 7, 6, 5, 4, 3, 2])
    assert bm.take_copies() == ([], []) and bm.events["offloaded"] == 0
    assert prefill(bm, make_seq(2, [1, 2, 3, 4, 5])) == 0


def test_swap_out_holds_each_full_block_once_and_resumes_from_the_host():
    bm = tiered(host=4, offload=False)
    seq = make_seq(0, [1, 2, 3, 4, 5])
    prefill(bm, seq)
    twin = make_seq(1, [1, 2, 3, 4, 9])  # shares both full blocks
    prefill(bm, twin)
    holds = bm.swap_out(seq)
    assert len(holds) == 2 and bm.events["swapped_out"] == 2
    assert bm.swap_out(twin) == holds  # the same blocks: shared slots, no new copies
    assert bm.events["swapped_out"] == 2 and len(bm.copies_out) == 2
    assert [bm.host.blocks[s].ref_count for s in holds] == [2, 2]
    for s, h in ((seq, holds), (twin, holds)):
        bm.free(s)
        s.host_blocks = list(h)
    bm.take_copies()
    run_and_free(bm, 2, [9, 8, 7, 6, 5, 4, 3, 2])  # the device copies are gone
    resumed = make_seq(0, seq.token_ids)
    resumed.host_blocks = seq.host_blocks
    assert bm.allocate_cached_prefix(resumed) == 4
    bm.count_hits(resumed)
    assert bm.events["swapped_in"] == 2 and bm.events["hit_host"] == 0
    bm.release_host(resumed)
    assert resumed.host_blocks == [] and [bm.host.blocks[s].ref_count for s in holds] == [2, 2]
    bm.take_copies()
    assert [bm.host.blocks[s].ref_count for s in holds] == [1, 1]  # the twin's holds
    bm.release_host(twin)
    bm.free(resumed)
    bm.check_invariants([])
    assert bm.host.usage() == {"used": 0, "cached": 2, "free": 2}


def test_swap_out_without_room_holds_nothing_and_forgets_what_it_stored():
    bm = tiered(num_blocks=8, host=1, offload=False)
    seq = make_seq(0, [1, 2, 3, 4, 5])
    prefill(bm, seq)
    assert bm.swap_out(seq) is None
    assert bm.copies_out == [] and bm.events["swapped_out"] == 0
    assert bm.host.usage() == {"used": 0, "cached": 0, "free": 1}
    assert bm.host.hash_to_block == {}
    assert bm.swap_out(make_seq(1, [1])) is None  # nothing full to keep
    assert BlockManager(4, BS).swap_out(seq) is None  # no host tier


def test_a_full_host_tier_stores_nothing():
    bm = tiered(host=1)
    seq = make_seq(0, [1, 2, 3, 4, 5])
    prefill(bm, seq)
    block = bm.blocks[seq.block_table[0]]
    slot = bm.host.store(block)
    assert slot == 0 and bm.host.store(block) is None


def test_host_lookups_reject_other_tokens_or_another_prefix():
    bm = tiered(num_blocks=8, host=2)
    seq = make_seq(0, [1, 2, 3, 4, 5])
    prefill(bm, seq)
    b0, b1 = (bm.blocks[b] for b in seq.block_table[:2])
    s0, s1 = bm.host.store(b0), bm.host.store(b1)
    host = bm.host
    assert host.find(b0.hash, b0.token_ids, 0) == s0
    assert host.find(b1.hash, b1.token_ids, b1.parent_prefix_id) == s1
    assert host.find(b1.hash, b1.token_ids, b1.parent_prefix_id + 99) is None  # collision
    assert host.find(b0.hash, (7, 7), 0) is None
    assert host.find(12345, b0.token_ids, 0) is None
    # a slot reused for another block drops the old hash
    host.release(s0)
    host.release(s1)
    other = make_seq(1, [8, 9, 10, 11])
    prefill(bm, other)
    s = host.store(bm.blocks[other.block_table[0]])
    assert s == s0 and host.find(b0.hash, b0.token_ids, 0) is None
    assert b0.hash not in host.hash_to_block


def test_reset_and_invariants_see_the_host_tier():
    bm = tiered()
    seq = make_seq(0, [1, 2, 3, 4, 5])
    prefill(bm, seq)
    holds = bm.swap_out(seq)
    bm.free(seq)
    seq.host_blocks = holds
    assert bm.reset_prefix_cache() is False  # a swapped sequence holds host blocks
    bm.check_invariants([seq])
    with pytest.raises(AssertionError):
        bm.check_invariants([])  # a held slot no live sequence accounts for
    bm.release_host(seq)
    bm.take_copies()
    assert bm.usage()["host"] == {"used": 0, "cached": 2, "free": 2}
    assert bm.reset_prefix_cache() is True
    assert bm.usage()["host"] == {"used": 0, "cached": 0, "free": 4}
    assert bm.host.hash_to_block == {}


def test_usage_counts_each_tier():
    bm = tiered()
    seq = make_seq(0, [1, 2, 3, 4, 5])
    compute(bm, seq, 5)
    assert bm.usage()["device"] == {"used": 3, "cached": 0, "free": 1}
    bm.free(seq)
    assert bm.usage()["device"] == {"used": 0, "cached": 2, "free": 2}
    assert BlockManager(4, BS).usage()["host"] == {"used": 0, "cached": 0, "free": 0}


def test_the_host_tier_needs_prefix_caching():
    bm = BlockManager(4, BS, enable_prefix_caching=False, num_host_blocks=4, offload=True)
    assert bm.host is None and bm.offload is False


def test_block_events_count_every_block_once_and_add_up():
    bm = tiered(num_blocks=8)
    a = [1, 2, 3, 4, 5]
    run_and_free(bm, 0, a)  # 3 blocks taken, 3 freed, no hit
    assert (bm.events["allocated"], bm.events["freed"], bm.events["hit_device"]) == (3, 3, 0)
    run_and_free(bm, 1, a)  # 2 full blocks hit, 1 fresh block
    run_and_free(bm, 2, a)
    assert (bm.events["allocated"], bm.events["freed"], bm.events["hit_device"]) == (5, 9, 4)
    assert all(type(v) is int for v in bm.events.values())
    # host hits add up the same way
    bm = tiered()
    b = [9, 8, 7, 6, 5, 4, 3, 2]
    run_and_free(bm, 0, a)
    run_and_free(bm, 1, b)  # a's blocks go to the host
    bm.take_copies()
    run_and_free(bm, 2, a)  # a's 2 blocks come back, pushing b's out
    assert bm.events["hit_host"] == 2
    bm.take_copies()
    again, _ = run_and_free(bm, 3, b)
    assert again.num_host_prefix_blocks > 0
    assert bm.events["hit_host"] == 2 + again.num_host_prefix_blocks


def test_a_host_tier_clears_only_when_nothing_is_held():
    bm = tiered()
    block = bm.blocks[0]
    block.hash, block.token_ids = 42, (1, 2)
    slot = bm.host.store(block)
    assert bm.host.clear() is False and bm.host.hash_to_block == {42: slot}
    bm.host.release(slot)
    assert bm.host.clear() is True and bm.host.hash_to_block == {}


def test_reusing_a_slot_keeps_a_newer_slot_of_the_same_hash_findable():
    """Two blocks can share a hash (a collision: other tokens or another prefix); the map
    points at the newest, and reusing the older slot must not drop it."""
    bm = tiered(host=2)
    old, new = bm.blocks[0], bm.blocks[1]
    old.hash, old.token_ids, old.parent_prefix_id = 7, (1, 2), 0
    new.hash, new.token_ids, new.parent_prefix_id = 7, (3, 4), 0
    s_old = bm.host.store(old)
    s_new = bm.host.store(new)
    assert bm.host.hash_to_block == {7: s_new}
    bm.host.release(s_old)
    other = bm.blocks[2]
    other.hash, other.token_ids = 9, (5, 6)
    assert bm.host.store(other) == s_old  # the old slot is reused
    assert bm.host.find(7, (3, 4), 0) == s_new


def test_offload_is_off_unless_asked_for():
    assert BlockManager(4, BS, num_host_blocks=4).offload is False
