"""The bytes follow the books: random scheduler runs with swap and a host prefix cache, whose
copies go through the real `HostKVPool` over a KV tensor (CPU; marked gpu, CUDA with its
side stream and the copies out behind the forward pass).

The scheduler harness (tests/core/scheduler_harness.py) keeps a model of what each cache
slot holds (the token prefix whose K/V lives there) and of each host slot, moved in the
order the step's copies say. Here every such content also has a number, written into the
tensor where the fake forward pass computes it; after each step the tensor and the host
pool must hold exactly the numbers of the model, and each sequence must read its context's
numbers from the tensor, on the stream the forward pass runs on."""

import random

import torch

from nanovllm.worker.host_pool import HostKVPool
from tests.core.scheduler_harness import EOS, FakeEngine, make_scheduler


class TensorEngine(FakeEngine):
    def __init__(self, sched, device: str, next_token) -> None:
        super().__init__(sched, next_token)
        bm = sched.block_manager
        self.device = device
        # [2 (K, V), layers, blocks, block_size, kv_heads, head_dim]: one number a slot (V
        # holds its negative, so K and V are both checked)
        self.cache = torch.zeros((2, 1, bm.num_blocks, bm.block_size, 1, 1), device=device)
        self.pool = HostKVPool(_Cache(self.cache), bm.host.num_blocks)
        self.pool.tensor.zero_()
        self.ids: dict[tuple[int, ...], float] = {}

    def number(self, content) -> float:
        if content is None:
            return 0.0
        return self.ids.setdefault(content, float(len(self.ids) + 1))

    def copy(self, out, in_) -> None:
        super().copy(out, in_)
        self.pool.copy(out, in_)

    def _forward(self, seqs, on_device) -> None:
        bs = self.sched.block_manager.block_size
        for seq in seqs:  # what the context reads, on the forward pass's stream
            slots = [(b, i) for b in seq.block_table for i in range(bs)]
            want = [self.number(self.kv.get(s)) for s in slots[:seq.num_computed_tokens]]
            if want:
                blocks = torch.tensor([b for b, _ in slots[:len(want)]], device=self.device)
                offsets = torch.tensor([i for _, i in slots[:len(want)]], device=self.device)
                got = self.cache[0, 0, blocks, offsets, 0, 0].tolist()
                assert got == want, (seq, got, want)
        super()._forward(seqs, on_device)
        for seq in seqs:  # what it computes, written where its K/V goes
            end = seq.num_computed_tokens + seq.num_scheduled_tokens
            for p in range(seq.num_computed_tokens, end):
                b, i = seq.block_table[p // bs], p % bs
                value = self.number(self.kv[(b, i)])
                self.cache[0, 0, b, i] = value
                self.cache[1, 0, b, i] = -value

    def check_after_step(self) -> None:
        super().check_after_step()
        bm = self.sched.block_manager
        want = torch.tensor([[self.number(self.kv.get((b, i))) for i in range(bm.block_size)]
                             for b in range(bm.num_blocks)])
        got = self.cache[:, 0, :, :, 0, 0].cpu()  # waits for the queued work
        assert torch.equal(got, torch.stack([want, -want])), (got, want)
        for slot, contents in self.host.items():
            want = [self.number(c) for c in contents]
            assert self.pool.tensor[slot, 0, 0, :, 0, 0].tolist() == want, ("host", slot)


class _Cache:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def run(device: str, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    block_size, max_len = rng.choice([2, 4]), 24
    per_seq = max_len // block_size
    sched = make_scheduler(
        "fair", num_blocks=per_seq + rng.randrange(per_seq), block_size=block_size,
        max_num_seqs=4, max_num_batched_tokens=16, max_model_len=max_len,
        num_host_blocks=rng.randrange(2, 2 * per_seq), swap=True, offload=True,
        preemption_mode="swap")
    scripts: dict[int, list[int]] = {}
    eng = TensorEngine(sched, device, lambda s: scripts[s.seq_id][s.num_output_tokens])
    bases = [[rng.randrange(20) for _ in range(max_len)] for _ in range(2)]
    for n in range(16):  # shared prefixes: hits on the device and the host, swaps back in
        length = rng.randrange(2, max_len - 4)
        shared = rng.randrange(length + 1)
        scripts[n] = [rng.choice((EOS,) + (7,) * 12) for _ in range(max_len)]
        eng.add(rng.choice(bases)[:shared] + [rng.randrange(20) for _ in range(length - shared)],
                priority=rng.choice((0, 1)), max_tokens=rng.randrange(1, 10))
        for _ in range(rng.randrange(3)):
            if eng.has_work():
                eng.step()
    eng.run()
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert len(bm.host.free) == bm.host.num_blocks
    return bm.events


def test_swap_and_offload_move_the_bytes_the_block_manager_says(device):
    seen = set()
    for seed in range(8):
        events = run(device, seed)
        seen |= {k for k in ("swapped_out", "swapped_in", "offloaded", "hit_host") if events[k]}
    assert seen == {"swapped_out", "swapped_in", "offloaded", "hit_host"}  # the runs cover them
