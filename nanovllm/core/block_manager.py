from array import array
from collections import OrderedDict
from itertools import count

import xxhash

from nanovllm.core.host_tier import HostTier
from nanovllm.core.kv_block import Block
from nanovllm.core.sequence import Sequence

# what `BlockManager.events` counts; the step trace's "blocks" (core/step_trace.py) and
# /metrics report them
BLOCK_EVENTS = ("allocated", "freed", "hit_device", "hit_host", "swapped_out", "swapped_in",
                "offloaded")


def hash_block(token_ids: list[int], prefix_hash: int) -> int:
    """Content hash of a full block, chained over everything before it."""
    h = xxhash.xxh64(prefix_hash.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    return h.intdigest()


class BlockManager:
    """Physical KV blocks: a free list, ref counts, and content-addressed prefix caching,
    with an optional host tier (`num_host_blocks`).

    Only full, computed blocks are hashed. A freed block keeps its hash and stays
    findable until it is handed out again; the free list is ordered so the least
    recently freed block is reused first. With `offload`, a cached block that is handed
    out again is first copied to the host tier, where a later prefix lookup finds it and
    copies it back (`hit_host`). `swap_out` copies a preempted sequence's full blocks to
    the host tier and holds them there until it resumes (`swapped_in`).

    Copies are bookkeeping here: each step takes them (`take_copies`), device -> host
    first, then host -> device, before its forward pass writes anything. A host slot a
    copy reads stays referenced until the step has taken its copies, so no later copy of
    the same step can overwrite it.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0, offload: bool = False, cache_events: bool = False):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self._prefix_ids = count(1)
        # KV cache events (engine/kv_events.py publishes them): ("stored", medium, hash,
        # parent hash, token ids), ("removed", medium, hash), ("cleared",), as a hash
        # becomes findable in a tier or stops being so
        self.cache_events: list | None = [] if cache_events else None
        self.host = (HostTier(num_host_blocks, self.cache_events)
                     if num_host_blocks and enable_prefix_caching else None)
        self.offload = offload and self.host is not None
        self.copies_out: list[tuple[int, int]] = []  # (device block, host slot)
        self.copies_in: list[tuple[int, int]] = []  # (host slot, device block)
        self._step_holds: list[int] = []  # host slots read by pending copies
        self.events = dict.fromkeys(BLOCK_EVENTS, 0)  # running totals (trace, metrics)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def usage(self) -> dict[str, dict[str, int]]:
        """Blocks per tier: used (referenced), cached (free, findable), free."""
        cached = sum(1 for b in self.free_blocks if self.blocks[b].hash != -1)
        device = {"used": self.num_blocks - self.num_free_blocks, "cached": cached,
                  "free": self.num_free_blocks - cached}
        host = self.host.usage() if self.host else {"used": 0, "cached": 0, "free": 0}
        return {"device": device, "host": host}

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, in both tiers (benchmarks repeat a workload from a
        cold cache); False, and nothing changed, while any block is in use."""
        if self.num_free_blocks != self.num_blocks or (
                self.host and len(self.host.free) != self.host.num_blocks):
            return False
        for block in self.blocks:
            block.hash, block.token_ids = -1, ()
        self.hash_to_block.clear()
        if self.host:
            self.host.clear()
        if self.cache_events is not None:
            self.cache_events.append(("cleared",))
        return True

    def take_cache_events(self) -> list:
        """The cache events since the last call (empty unless recorded)."""
        if not self.cache_events:
            return []
        events = list(self.cache_events)
        self.cache_events.clear()  # the same list the host tier appends to
        return events

    def _index(self, block: Block) -> None:
        """A registered device block becomes findable by its hash."""
        if self.cache_events is not None and block.hash not in self.hash_to_block:
            self.cache_events.append(("stored", "GPU", block.hash, block.parent_hash,
                                      block.token_ids))
        self.hash_to_block[block.hash] = block.block_id

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The copies the next step must run before its forward pass: (out, in)."""
        out, in_ = self.copies_out, self.copies_in
        self.copies_out, self.copies_in = [], []
        for slot in self._step_holds:
            self.host.release(slot)
        self._step_holds = []
        return out, in_

    def _take_free_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash != -1:
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
                if self.cache_events is not None:
                    self.cache_events.append(("removed", "GPU", block.hash))
                if self.offload:
                    self._offload(block)
            block.hash = -1
            block.token_ids = ()
        block.ref_count = 1
        self.events["allocated"] += 1
        return block_id

    def _offload(self, block: Block) -> None:
        """A cached block leaves the device: keep a copy in the host tier."""
        if self.host.find(block.hash, block.token_ids, block.parent_prefix_id) is not None:
            return
        slot = self.host.store(block)
        if slot is not None:
            self.copies_out.append((block.block_id, slot))
            self.host.release(slot)
            self.events["offloaded"] += 1

    def allocate_cached_prefix(self, seq: Sequence) -> int:
        """Give a sequence without blocks the cached blocks of its longest cached prefix,
        from the device, else from the host tier (copied back into fresh device blocks).

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
        from_host = 0
        for i in range(num_lookup):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = hash_block(tokens, prefix_hash)
            block_id = self.hash_to_block.get(h)
            if block_id is not None and self._holds(block_id, tokens, parent):
                block = self.blocks[block_id]
                if block.ref_count == 0:
                    del self.free_blocks[block_id]
                block.ref_count += 1
            else:  # a miss, or a hash collision: the host tier, else stop
                slot = self.host.find(h, tokens, parent) if self.host else None
                if slot is None or not self.free_blocks:
                    break
                self.host.take(slot)
                self._step_holds.append(slot)
                block_id = self._take_free_block()
                block, src = self.blocks[block_id], self.host.blocks[slot]
                block.hash, block.token_ids = h, tokens
                block.prefix_id, block.parent_prefix_id = src.prefix_id, src.parent_prefix_id
                block.parent_hash = prefix_hash if i else None
                self._index(block)
                self.copies_in.append((slot, block_id))
                from_host += 1
            parent = block.prefix_id
            seq.block_table.append(block_id)
            seq.block_hashes.append(h)
            prefix_hash = h
        hit = len(seq.block_table) * bs
        seq.num_computed_tokens = hit
        seq.num_cached_prefix_tokens = hit
        seq.num_host_prefix_blocks = from_host
        return hit

    def count_hits(self, seq: Sequence) -> None:
        """`seq` was admitted with its cached prefix: count its blocks by tier (a lookup
        whose admission is undone and retried counts once)."""
        host = seq.num_host_prefix_blocks
        self.events["hit_device"] += seq.num_cached_prefix_tokens // self.block_size - host
        self.events["swapped_in" if seq.host_blocks else "hit_host"] += host

    def _holds(self, block_id: int, tokens: tuple[int, ...], parent_prefix_id: int) -> bool:
        block = self.blocks[block_id]
        return block.token_ids == tokens and block.parent_prefix_id == parent_prefix_id

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
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
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
                block.token_ids = tokens
                block.parent_hash = prefix_hash if i else None
                self._index(block)

    def swap_out(self, seq: Sequence) -> list[int] | None:
        """Copy a running sequence's full computed blocks to the host tier and hold them
        there (a slot that already holds the block is shared); the held slots, or None
        (nothing held) when the host tier has no room or there is nothing to copy."""
        if self.host is None or not seq.block_hashes:
            return None
        holds, copies = [], []
        for i in range(len(seq.block_hashes)):
            block = self.blocks[seq.block_table[i]]
            slot = self.host.find(block.hash, block.token_ids, block.parent_prefix_id)
            if slot is not None:
                self.host.take(slot)
            else:
                slot = self.host.store(block)
                if slot is None:  # full: let go of what was taken (its copies never run)
                    for s in holds:
                        self.host.release(s)
                    for _, s in copies:
                        b = self.host.blocks[s]
                        if self.host.hash_to_block.get(b.hash) == s:
                            self.host.forget(b.hash)
                        b.hash, b.token_ids = -1, ()
                    return None
                copies.append((block.block_id, slot))
            holds.append(slot)
        self.copies_out += copies
        self.events["swapped_out"] += len(copies)
        return holds

    def release_host(self, seq: Sequence) -> None:
        """Let go of a swapped sequence's held host blocks (they stay cached there)."""
        for slot in seq.host_blocks:
            self.host.release(slot)
        seq.host_blocks = []

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's device references; its tail blocks become the first to be
        reused. Host blocks held for a swapped sequence stay held (`release_host`)."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
                self.events["freed"] += 1
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def check_invariants(self, live: list[Sequence]) -> None:
        """Ref counts equal the number of live block tables holding each block, in both
        tiers (for tests)."""
        counts = [0] * self.num_blocks
        for seq in live:
            for block_id in seq.block_table:
                counts[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == counts[block.block_id], (block.block_id, block.ref_count)
            assert (block.ref_count == 0) == (block.block_id in self.free_blocks)
        for h, block_id in self.hash_to_block.items():
            assert self.blocks[block_id].hash == h
        if self.host:
            holds = [s for seq in live for s in seq.host_blocks] + self._step_holds
            self.host.check_invariants(holds)
