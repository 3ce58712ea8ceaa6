"""BlockManager without a model: hashing, prefix reuse, ref counts, the free list."""

import pytest

from nanovllm.core import block_manager as bm_module
from nanovllm.core.block_manager import BlockManager, hash_block
from nanovllm.core.sampling_params import SamplingParams
from nanovllm.core.sequence import Sequence

BS = 4


def make_seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, tokens, SamplingParams())


def compute(bm: BlockManager, seq: Sequence, n: int) -> None:
    """Pretend a forward pass wrote K/V for `n` more tokens of `seq`."""
    assert bm.allocate(seq, n)
    seq.num_computed_tokens += n
    bm.register_full_blocks(seq)


def prefill(bm: BlockManager, seq: Sequence) -> int:
    """Admit `seq` the way the scheduler does; returns the prefix-cache hit in tokens."""
    hit = bm.allocate_cached_prefix(seq)
    compute(bm, seq, seq.num_tokens - seq.num_computed_tokens)
    return hit


def test_only_full_blocks_are_hashed_and_hashes_chain():
    bm = BlockManager(num_blocks=8, block_size=BS)
    tokens = list(range(10))
    seq = make_seq(0, tokens)
    compute(bm, seq, 3)
    assert seq.block_hashes == []  # a partial block is never hashed
    compute(bm, seq, 7)
    h0 = hash_block(tokens[0:4], 0)
    h1 = hash_block(tokens[4:8], h0)
    assert seq.block_hashes == [h0, h1]
    assert [bm.blocks[b].hash for b in seq.block_table] == [h0, h1, -1]
    assert h1 != hash_block(tokens[4:8], 0)  # the same tokens after another prefix differ
    bm.check_invariants([seq])


def test_shared_prefix_shares_blocks_and_counts_refs():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(0, list(range(10)))
    b = make_seq(1, list(range(9)) + [99, 98])
    assert prefill(bm, a) == 0
    assert prefill(bm, b) == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    assert bm.num_free_blocks == 8 - 4
    bm.check_invariants([a, b])
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table] == [1, 1, 1]
    bm.check_invariants([b])
    bm.free(b)
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_blocks


def test_cached_blocks_are_reusable_after_owner_finishes_until_reallocated():
    bm = BlockManager(num_blocks=4, block_size=BS)
    prompt = list(range(9))
    a = make_seq(0, prompt)
    prefill(bm, a)
    cached = a.block_table[:2]
    bm.free(a)
    assert bm.num_free_blocks == 4

    b = make_seq(1, prompt)
    assert prefill(bm, b) == 8 and b.block_table[:2] == cached
    bm.free(b)

    # a prompt with other tokens needs every block, so the cached ones are handed out again
    c = make_seq(2, [50 + i for i in range(16)])
    prefill(bm, c)
    bm.free(c)
    d = make_seq(3, prompt)
    assert prefill(bm, d) == 0
    bm.free(d)
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_blocks


def test_full_hit_still_leaves_one_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt = list(range(8))  # exactly two full blocks
    a = make_seq(0, prompt)
    prefill(bm, a)
    b = make_seq(1, prompt)
    hit = bm.allocate_cached_prefix(b)
    assert hit == 4 and b.num_computed_tokens == 4 == b.num_cached_prefix_tokens
    assert b.num_tokens - b.num_computed_tokens >= 1
    for length in (1, 4, 5):
        c = make_seq(2 + length, prompt[:length])
        assert bm.allocate_cached_prefix(c) < length
        bm.free(c)
    bm.free(b)
    bm.free(a)
    assert bm.num_free_blocks == bm.num_blocks


def test_hash_collision_is_never_reused(monkeypatch):
    monkeypatch.setattr(bm_module, "hash_block", lambda token_ids, prefix_hash: 7)
    bm = BlockManager(num_blocks=16, block_size=BS)
    x, y = [1, 2, 3, 4], [5, 6, 7, 8]
    a = make_seq(0, x + y + [9])
    prefill(bm, a)
    bm.free(a)  # both full blocks are cached, all under the one colliding hash
    assert bm.allocate_cached_prefix(make_seq(1, [0, 0, 0, 0, 1])) == 0  # other tokens
    # the tokens of a cached block, but at another position, after another prefix
    assert bm.allocate_cached_prefix(make_seq(2, y + [9])) == 0
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_blocks


def test_allocate_fails_cleanly_when_out_of_blocks():
    bm = BlockManager(num_blocks=2, block_size=BS)
    seq = make_seq(0, list(range(12)))
    assert bm.blocks_needed(seq, 12) == 3
    assert not bm.allocate(seq, 12)
    assert seq.block_table == [] and bm.num_free_blocks == 2
    assert bm.allocate(seq, 8)
    assert bm.blocks_needed(seq, 8) == 0 and bm.blocks_needed(seq, 9) == 1
    bm.free(seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert bm.num_free_blocks == 2


def test_prefix_caching_off_never_hits():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    prompt = list(range(9))
    a = make_seq(0, prompt)
    prefill(bm, a)
    assert a.block_hashes == [] and bm.hash_to_block == {}
    b = make_seq(1, prompt)
    assert prefill(bm, b) == 0 and b.num_cached_prefix_tokens == 0


def test_twin_blocks_computed_side_by_side_keep_the_chain():
    bm = BlockManager(num_blocks=16, block_size=BS)
    s, y, z = [1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]
    a, b = make_seq(0, s + y + [0]), make_seq(1, s + z + [0])
    for seq in (a, b):  # both admitted before either computes: two copies of block `s`
        assert bm.allocate_cached_prefix(seq) == 0
    for seq in (a, b):
        compute(bm, seq, seq.num_tokens)
    bm.free(a)
    bm.free(b)
    assert prefill(bm, make_seq(2, s + y + [0])) == 8


def test_block_after_another_prefix_is_not_reused_when_hashes_ignore_prefixes(monkeypatch):
    def hash_tokens_only(token_ids: list[int], prefix_hash: int) -> int:
        return hash(tuple(token_ids))

    monkeypatch.setattr(bm_module, "hash_block", hash_tokens_only)
    bm = BlockManager(num_blocks=16, block_size=BS)
    x, y, z = [1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]
    for i, prompt in enumerate((x + y + [0], z + y + [0])):
        seq = make_seq(i, prompt)
        prefill(bm, seq)
        bm.free(seq)
    # the cached `y` that the hash finds follows `z`, so only `x` may be reused
    assert bm.allocate_cached_prefix(make_seq(2, x + y + [0])) == 4


def test_reset_prefix_cache_forgets_cached_blocks_only_when_idle():
    bm = BlockManager(8, 2)
    seq = Sequence(0, [1, 2, 3, 4, 5], SamplingParams())
    bm.allocate(seq, 5)
    seq.num_computed_tokens = 5
    bm.register_full_blocks(seq)
    assert not bm.reset_prefix_cache()  # blocks in use: refused
    bm.free(seq)
    assert bm.reset_prefix_cache()
    again = Sequence(1, [1, 2, 3, 4, 5], SamplingParams())
    assert bm.allocate_cached_prefix(again) == 0
    bm.check_invariants([])


def test_a_cache_without_blocks_or_with_empty_blocks_is_refused():
    """num_blocks and block_size must both be positive."""
    for num_blocks, block_size in ((0, BS), (4, 0), (0, 0)):
        with pytest.raises(AssertionError):
            BlockManager(num_blocks, block_size)


def test_blocks_registered_one_step_at_a_time_are_each_hashed_once():
    """Registering after every chunk (as each step does) hashes each full block once, in
    chain order, and an identical prompt then hits every full block."""
    bm = BlockManager(num_blocks=8, block_size=BS)
    tokens = list(range(13))
    a = make_seq(0, tokens)
    for n in (4, 4, 3, 2):
        compute(bm, a, n)
    h0 = hash_block(tokens[0:4], 0)
    h1 = hash_block(tokens[4:8], h0)
    assert a.block_hashes == [h0, h1, hash_block(tokens[8:12], h1)]
    b = make_seq(1, tokens)
    assert prefill(bm, b) == 12 and b.block_table[:3] == a.block_table[:3]
    bm.check_invariants([a, b])


def test_reallocated_blocks_are_cached_under_their_new_tokens():
    """A cached block handed out again is forgotten under its old tokens and cached under
    the new ones, wherever it lands in the new block table (here a's first block ends
    b's table, behind a block never used before)."""
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_seq(0, list(range(9)))
    prefill(bm, a)
    bm.free(a)
    other = [50 + i for i in range(16)]
    b = make_seq(1, other)
    assert prefill(bm, b) == 0  # takes every block, the two cached ones included
    b_blocks = b.block_table
    bm.free(b)
    c = make_seq(2, other)
    assert prefill(bm, c) == 12 and c.block_table[:3] == b_blocks[:3]
    bm.free(c)
    assert prefill(bm, make_seq(3, list(range(9)))) == 0  # a's blocks hold b's tokens now
