"""Synthetic step traces, written with the engine's own StepTrace: a toy scheduler (decodes
first, then prefill chunks under a token budget) over requests that arrive over time, with a
shared prompt prefix (device and host prefix hits), preemptions of either kind on the steps
asked for, cached blocks offloaded to the host tier, and finishes by stop, length and abort
(every third request ends by length, the last one is aborted after 3 tokens)."""

import math
import random
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from nanovllm.core.step_trace import StepTrace

BLOCK = 16


@dataclass
class Req:
    id: str
    seq: int
    arrival: float
    prompt: int
    output: int
    reason: str
    computed: int = 0
    generated: int = 0
    swapped: int = 0  # blocks on the host while swapped out
    hold: int = 0  # a preempted sequence waits until this step

    @property
    def total(self) -> int:
        return self.prompt + self.generated

    @property
    def blocks(self) -> int:
        return math.ceil(self.computed / BLOCK)


def simulate(path: Path, n_requests: int = 6, preempt: dict[int, str] | None = None,
             max_num_seqs: int = 4, budget: int = 96, num_kv_blocks: int = 96,
             num_host_blocks: int = 48, output: tuple[int, int] = (6, 14),
             arrival_span: float = 0.05, max_steps: int | None = None, seed: int = 0) -> Path:
    rng = random.Random(seed)
    pending = deque(sorted(
        (Req(f"cmpl-{i:04d}", i, rng.uniform(0, arrival_span), rng.randint(40, 200),
             rng.randint(*output), "stop" if i % 3 else "length") for i in range(n_requests)),
        key=lambda r: r.arrival))
    if n_requests > 2:
        pending[-1].reason = "abort"
    trace = StepTrace(str(path))
    trace.header(block_size=BLOCK, num_kv_blocks=num_kv_blocks, num_host_blocks=num_host_blocks,
                 max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                 config={"model": "tiny-llama", "policy": "fair", "enable_prefix_caching": True,
                         "swap_space_gib": 0.25, "max_model_len": 2048})
    preempt = dict(preempt or {})
    waiting: deque[Req] = deque()
    running: list[Req] = []
    t, cached, host_used, host_cached = 0.0, 0, 0, 0
    offloaded = 0  # after a step: in the next record
    while (pending or waiting or running) and (max_steps is None or trace.num_steps < max_steps):
        if not waiting and not running and pending[0].arrival > t:
            t = pending[0].arrival
        while pending and pending[0].arrival <= t:
            r = pending.popleft()
            trace.arrived(r.id, r.seq, r.prompt)
            waiting.append(r)
        ev = dict.fromkeys(("allocated", "freed", "hit_device", "hit_host", "swapped_out",
                            "swapped_in", "offloaded"), 0) | {"offloaded": offloaded}
        preempted = []
        kind = preempt.pop(trace.num_steps, None)
        if kind and running:
            victim = running.pop()
            preempted.append({"req": victim.id, "seq": victim.seq, "kind": kind})
            if kind == "swap":
                victim.swapped = victim.blocks
                host_cached = max(0, min(host_cached, num_host_blocks - host_used - victim.blocks))
                host_used += victim.blocks
                ev["swapped_out"] += victim.blocks
            else:
                cached += victim.blocks
                victim.computed = 0
            victim.hold = trace.num_steps + 3
            waiting.appendleft(victim)
        used = sum(r.blocks for r in running)
        while (waiting and len(running) < max_num_seqs and waiting[0].hold <= trace.num_steps
               and used + 16 + cached <= num_kv_blocks):
            r = waiting.popleft()
            if r.swapped:
                ev["swapped_in"] += r.swapped
                host_used -= r.swapped
                r.swapped = 0
            elif r.computed == 0 and r.generated == 0:  # the shared prefix, in either tier
                hits = {"hit_device": 2 * (cached >= 2), "hit_host": int(host_cached >= 1)}
                ev.update({k: ev[k] + v for k, v in hits.items()})
                r.computed = min(BLOCK * sum(hits.values()), r.prompt - 1)
            running.append(r)
            used += r.blocks
        rows, left = [], budget
        for r in sorted(running, key=lambda r: r.total - r.computed > 1):  # decodes first
            n = min(r.total - r.computed, left)
            if n <= 0:
                continue
            rows.append({"req": r.id, "seq": r.seq, "kind": "decode" if r.generated and n == 1
                         and r.total - r.computed == 1 else "prefill", "tokens": n,
                         "start": r.computed, "total": r.total})
            before = r.blocks
            r.computed += n
            ev["allocated"] += r.blocks - before
            left -= n
        for r in running:
            if r.computed == r.total:  # a token sampled
                r.generated += 1
        dur = 0.002 + 0.00003 * (budget - left) + rng.uniform(0, 0.0005)
        kv = {"device": {"used": sum(r.blocks for r in running), "cached": cached},
              "host": {"used": host_used, "cached": host_cached}}
        for tier, total in (("device", num_kv_blocks), ("host", num_host_blocks)):
            kv[tier]["free"] = max(0, total - kv[tier]["used"] - kv[tier]["cached"])
        for r in running[:]:
            if r.generated >= r.output or (r.reason == "abort" and r.generated >= 3):
                running.remove(r)
                trace.finished(r.id, r.seq, r.reason, r.generated)
                cached += r.blocks
                ev["freed"] += r.blocks
        trace.step(t, dur, rows, len(waiting), len(running), kv, ev, preempted)
        t += dur + 0.0002
        offloaded = 0
        if cached > num_kv_blocks // 4:  # the oldest cached blocks move to the host tier
            moved = cached - num_kv_blocks // 4
            cached -= moved
            offloaded = moved
            host_cached = min(num_host_blocks - host_used, host_cached + moved)
    trace.close()
    return path
