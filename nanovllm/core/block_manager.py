from array import array
from collections import OrderedDict
from itertools import count

import xxhash

from nanovllm.core.sequence import Sequence


def hash_block(token_ids: list[int], prefix_hash: int) -> int:
    """Content hash of a full block, chained over everything before it."""
    h = xxhash.xxh64(prefix_hash.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    return h.intdigest()


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "prefix_id", "parent_prefix_id")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1  # -1: not a registered full block
        self.token_ids: tuple[int, ...] = ()
        # equal ids <=> equal token prefixes through this block, whatever the hashes say
        self.prefix_id = 0
        self.parent_prefix_id = 0  # prefix_id of the block before it; 0: the first block


class BlockManager:
    """Physical KV blocks: a free list, ref counts, and content-addressed prefix caching.

    Only full, computed blocks are hashed. A freed block keeps its hash and stays
    findable until it is handed out again; the free list is ordered so the least
    recently freed block is reused first.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self._prefix_ids = count(1)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (benchmarks repeat a workload from a cold cache);
        False, and nothing changed, while any block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.hash, block.token_ids = -1, ()
        self.hash_to_block.clear()
        return True

    def _take_free_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash != -1:
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.hash = -1
            block.token_ids = ()
        block.ref_count = 1
        return block_id

    def allocate_cached_prefix(self, seq: Sequence) -> int:
        """Give a sequence without blocks the cached blocks of its longest cached prefix.

        At least one token is always left to compute, so the sequence produces logits.
        Returns the number of tokens found in the cache.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0
        seq.num_cached_prefix_tokens = 0
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        num_lookup = (seq.num_tokens - 1) // bs
        prefix_hash = parent = 0
        for i in range(num_lookup):
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            h = hash_block(tokens, prefix_hash)
            block_id = self.hash_to_block.get(h)
            if block_id is None or not self._holds(block_id, tokens, parent):
                break  # a miss, or a hash collision
            block = self.blocks[block_id]
            parent = block.prefix_id
            if block.ref_count == 0:
                del self.free_blocks[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            seq.block_hashes.append(h)
            prefix_hash = h
        hit = len(seq.block_table) * bs
        seq.num_computed_tokens = hit
        seq.num_cached_prefix_tokens = hit
        return hit

    def _holds(self, block_id: int, tokens: list[int], parent_prefix_id: int) -> bool:
        block = self.blocks[block_id]
        return block.token_ids == tuple(tokens) and block.parent_prefix_id == parent_prefix_id

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Extend the block table to hold `num_new_tokens` more tokens; False if out of blocks."""
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > self.num_free_blocks:
            return False
        for _ in range(needed):
            seq.block_table.append(self._take_free_block())
        return True

    def register_full_blocks(self, seq: Sequence) -> None:
        """Hash the blocks that became full and computed, so later prompts can reuse them."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        for i in range(len(seq.block_hashes), num_full):
            prefix_hash = seq.block_hashes[-1] if seq.block_hashes else 0
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            h = hash_block(tokens, prefix_hash)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if block.hash == -1:
                parent = self.blocks[seq.block_table[i - 1]].prefix_id if i else 0
                same = self.hash_to_block.get(h)
                if same is not None and self._holds(same, tokens, parent):
                    block.prefix_id = self.blocks[same].prefix_id  # a twin computed elsewhere
                else:
                    block.prefix_id = next(self._prefix_ids)
                block.parent_prefix_id = parent
                block.hash = h
                block.token_ids = tuple(tokens)
                self.hash_to_block[h] = block.block_id

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; its tail blocks become the first to be reused."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def check_invariants(self, live: list[Sequence]) -> None:
        """Ref counts equal the number of live block tables holding each block (for tests)."""
        counts = [0] * self.num_blocks
        for seq in live:
            for block_id in seq.block_table:
                counts[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == counts[block.block_id], (block.block_id, block.ref_count)
            assert (block.ref_count == 0) == (block.block_id in self.free_blocks)
        for h, block_id in self.hash_to_block.items():
            assert self.blocks[block_id].hash == h
