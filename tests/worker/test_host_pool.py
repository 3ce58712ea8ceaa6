"""HostKVPool.copy: the bytes of a step's copies between the KV cache and host slots, in the
order the BlockManager relies on, with the host transfers of copied-out blocks left to run
behind the forward pass on a GPU."""

from types import SimpleNamespace

import pytest
import torch

from nanovllm.worker.host_pool import HostKVPool, page_locked, registers

# [2 (K, V), layers, blocks, block_size, kv_heads, head_dim]: 2 MiB a block on purpose, so
# that on a GPU a host copy takes long enough for a missing wait to show
SHAPE = (2, 4, 6, 64, 8, 128)


def make_pool(device: str) -> tuple[torch.Tensor, HostKVPool]:
    cache = torch.randn(SHAPE, device=device)
    return cache, HostKVPool(SimpleNamespace(tensor=cache), num_slots=4)


def block(cache: torch.Tensor, b: int) -> torch.Tensor:
    return cache[:, :, b].clone()


def test_a_step_copies_out_before_in_and_the_forward_pass_may_overwrite(device):
    cache, pool = make_pool(device)
    pool.tensor[2].copy_(torch.randn(pool.tensor.shape[1:]))  # a block swapped out earlier
    before = {b: block(cache, b) for b in range(3)}
    slot2 = pool.tensor[2].clone()
    # block 0 goes out to slot 0 and, in the same step, slot 2 comes back into block 0;
    # block 1 goes out to slot 1 and the step's forward pass then writes over it
    pool.copy([(0, 0), (1, 1)], [(2, 0)])
    cache[:, :, 1].fill_(-1.0)  # on the current stream, right after, as a forward pass would
    # a later step brings slot 0 back into block 2: it reads what the first step wrote there
    pool.copy([], [(0, 2)])
    if device == "cuda":
        torch.cuda.synchronize()
    torch.testing.assert_close(pool.tensor[0], before[0].cpu(), rtol=0, atol=0)
    torch.testing.assert_close(pool.tensor[1], before[1].cpu(), rtol=0, atol=0)
    torch.testing.assert_close(block(cache, 0).cpu(), slot2, rtol=0, atol=0)
    torch.testing.assert_close(block(cache, 2), before[0], rtol=0, atol=0)


def test_a_slot_written_and_read_in_one_step_reads_what_was_written(device):
    # the BlockManager offloads an evicted block to a slot and, in the same step, a prefix
    # lookup finds it there and copies it back into another block; the slot is written
    # twice (the LRU slot reused), and the read comes after the last write
    cache, pool = make_pool(device)
    before = {b: block(cache, b) for b in range(3)}
    pool.copy([(0, 3), (1, 3)], [(3, 2)])
    cache[:, :, 1].fill_(-1.0)  # the forward pass writes over the block it evicted
    if device == "cuda":
        torch.cuda.synchronize()
    torch.testing.assert_close(block(cache, 2), before[1], rtol=0, atol=0)
    torch.testing.assert_close(pool.tensor[3], before[1].cpu(), rtol=0, atol=0)


def test_the_forward_pass_sees_blocks_copied_in(device):
    """A kernel on the current stream right after `copy` reads the block as copied in."""
    cache, pool = make_pool(device)
    pool.tensor[3].copy_(torch.randn(pool.tensor.shape[1:]))
    pool.copy([(4, 0)], [(3, 5)])
    got = cache[:, :, 5].sum(dim=(2, 3, 4)).cpu()  # queued at once, no synchronize first
    want = pool.tensor[3].sum(dim=(2, 3, 4))
    # sums of 64k floats in the GPU's order against the CPU's (~1e-5 apart); a block not yet
    # copied in would hold other random values altogether
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)


def test_a_large_pool_is_registered_instead_of_rounded_up_to_a_power_of_two():
    gib = 2**30
    assert registers(20 * gib + 123)  # the pinned allocator would take 32 GiB
    assert registers(int(1.5 * gib))
    assert not registers(4 * gib - 2**21)  # the default 4 GiB of swap, less a part-block
    assert not registers(gib - 1)  # small pools: the pinned allocator
    assert not registers(int(7.6 * gib))  # within a sixteenth of 8 GiB


@pytest.mark.gpu
def test_a_registered_pool_copies_asynchronously_and_exactly():
    stats = getattr(torch.cuda, "host_memory_stats", lambda: {})
    before = stats().get("allocated_bytes.current")
    rows = int(1.25 * 2**30) // (4 * 2**20)  # 1.25 GiB: registered, not rounded to 2
    host = page_locked((rows, 2**20), torch.float32)
    assert host.is_pinned() and host.shape == (rows, 2**20)
    src = torch.randn(rows, 2**20, device="cuda")
    host.copy_(src, non_blocking=True)
    back = torch.empty_like(src)
    back.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, src)
    if before is not None:  # none of it came from torch's pinned allocator
        assert stats()["allocated_bytes.current"] - before < 2**30
    del host  # unregistered (a synchronize first): the process goes on using CUDA
    torch.cuda.synchronize()
