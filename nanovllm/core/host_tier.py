"""The host tier of the KV cache: slots in host memory for blocks copied off the device, and
what copying a preempted sequence there costs against recomputing it."""

from collections import OrderedDict
from dataclasses import dataclass

from nanovllm.core.kv_block import Block


class HostTier:
    """The host tier of the KV cache: block slots in host memory, found by content hash.

    Two kinds of blocks live here:
    - held: a preempted sequence's full blocks, copied out when it was swapped (ref > 0);
      they stay until it resumes;
    - cached: blocks that left the device prefix cache, or that a resumed sequence let go,
      kept least recently used first in `free` and findable by hash until their slot is
      reused.
    Only bookkeeping: the runner copies the bytes (worker/host_pool.py, HostKVPool) in the
    order the BlockManager hands out with each step.
    """

    def __init__(self, num_blocks: int, events: list | None = None) -> None:
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.events = events  # BlockManager.cache_events, when recorded

    def find(self, h: int, tokens: tuple[int, ...], parent_prefix_id: int) -> int | None:
        """The slot holding this exact block (hash, tokens and what precedes it), if any."""
        slot = self.hash_to_block.get(h)
        if slot is None:
            return None
        b = self.blocks[slot]
        return slot if b.token_ids == tokens and b.parent_prefix_id == parent_prefix_id else None

    def take(self, slot: int) -> None:
        """One more reference to a slot (a hit, or a hold)."""
        b = self.blocks[slot]
        if b.ref_count == 0:
            del self.free[slot]
        b.ref_count += 1

    def release(self, slot: int) -> None:
        b = self.blocks[slot]
        b.ref_count -= 1
        assert b.ref_count >= 0, f"host block {slot} released twice"
        if b.ref_count == 0:
            self.free[slot] = None  # most recently used: evicted last

    def store(self, src: Block) -> int | None:
        """A slot for a copy of device block `src` (its hash, tokens and prefix ids), taken
        with one reference; the least recently used cached block is evicted for it. None when
        every slot is referenced."""
        if not self.free:
            return None
        slot, _ = self.free.popitem(last=False)
        b = self.blocks[slot]
        if b.hash != -1 and self.hash_to_block.get(b.hash) == slot:
            self.forget(b.hash)
        b.ref_count = 1
        b.hash, b.token_ids = src.hash, src.token_ids
        b.prefix_id, b.parent_prefix_id = src.prefix_id, src.parent_prefix_id
        b.parent_hash = src.parent_hash
        if self.events is not None and b.hash not in self.hash_to_block:
            self.events.append(("stored", "CPU", b.hash, b.parent_hash, b.token_ids))
        self.hash_to_block[b.hash] = slot
        return slot

    def forget(self, h: int) -> None:
        """The hash is no longer findable in this tier."""
        del self.hash_to_block[h]
        if self.events is not None:
            self.events.append(("removed", "CPU", h))

    def usage(self) -> dict[str, int]:
        used = self.num_blocks - len(self.free)
        cached = sum(1 for s in self.free if self.blocks[s].hash != -1)
        return {"used": used, "cached": cached, "free": len(self.free) - cached}

    def clear(self) -> bool:
        if len(self.free) != self.num_blocks:
            return False
        for b in self.blocks:
            b.hash, b.token_ids = -1, ()
        self.hash_to_block.clear()
        return True

    def check_invariants(self, holds: list[int]) -> None:
        counts = [0] * self.num_blocks
        for slot in holds:
            counts[slot] += 1
        for b in self.blocks:
            assert b.ref_count == counts[b.block_id], ("host", b.block_id, b.ref_count)
            assert (b.ref_count == 0) == (b.block_id in self.free)
        for h, slot in self.hash_to_block.items():
            assert self.blocks[slot].hash == h


@dataclass(frozen=True)
class PreemptionCost:
    """What preempting a sequence costs each way, from rates the runner measured at start-up
    (worker/host_pool.py, measure_preemption_cost): swapping copies its full blocks out and
    back in; recomputing runs its tokens through the model again, a prefill whose
    attention grows with the square of its length."""

    block_bytes: int  # one block's K and V over all layers
    copy_bytes_per_s: float  # device <-> host, each way
    flops_per_token: float  # 2 x parameters
    attention_flops: float  # x n^2 for an n-token causal prefill
    flops_per_s: float  # the device's rate on the model's matmuls
    # the copy out runs behind the step's forward pass (on a GPU, HostKVPool): only the
    # copy back in is waited for
    out_hidden: bool = False

    def swap_seconds(self, num_blocks: int) -> float:
        ways = 1 if self.out_hidden else 2
        return ways * num_blocks * self.block_bytes / self.copy_bytes_per_s

    def recompute_seconds(self, num_tokens: int) -> float:
        n = num_tokens
        return (self.flops_per_token * n + self.attention_flops * n * n) / self.flops_per_s
