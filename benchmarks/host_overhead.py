"""Host time of one decode step's bookkeeping, without a model: scheduling, input
preparation, the sampler's host side, advance and resolve, for 256 rows with ~1,000-token
contexts.

    python -m benchmarks.host_overhead [--rows 256] [--steps 200] [--sampler torch]

The sampler's host side is the GPU default's (`--sampler one-pass`: each row's temperature,
which rides in the inputs' copy) or the torch sampler's (`torch`: sampling tensors built
from every row's parameters and output lengths, as when a row uses penalties or top-k/p).

On a GPU this work must stay below the GPU's step time for CPU/GPU overlap to hide it.
"""

import argparse
import json
import random
import time

import torch

from benchmarks.workloads import QWEN3_CONFIG
from nanovllm.core.block_manager import BlockManager
from nanovllm.core.config import EngineConfig
from nanovllm.core.sampling_params import SamplingParams
from nanovllm.core.scheduler import Scheduler
from nanovllm.core.sequence import Sequence
from nanovllm.engine.resolve import fit_kv_cache, resolve_config
from nanovllm.model.config import ModelConfig
from nanovllm.worker.inputs import InputBuffers
from nanovllm.worker.sampling import build_sampling_tensors, plain_temperatures


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--sampler", choices=["one-pass", "torch"], default="one-pass")
    args = ap.parse_args()
    random.seed(0)
    asked = EngineConfig(max_num_seqs=512, max_num_batched_tokens=16384, block_size=16,
                         max_model_len=4096, device="cpu")
    model = ModelConfig.from_hf(json.loads(QWEN3_CONFIG.read_text()))
    cfg = fit_kv_cache(resolve_config(asked, model), asked, args.rows * 200)
    bm = BlockManager(cfg.num_kv_blocks, cfg.block_size)
    sched = Scheduler(cfg, bm)
    seqs = []
    for i in range(args.rows):
        prompt = [random.randrange(10000) for _ in range(random.randint(500, 1000))]
        seq = Sequence(i, prompt, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=2000))
        sched.add(seq)
        seqs.append(seq)
    while sched.waiting or any(s.in_prefill for s in sched.running):  # prefill, no model
        batch = sched.schedule()
        sched.advance(batch)
        sched.resolve(batch.sampling_seqs, [1] * len(batch.sampling_seqs))
    device = torch.device("cpu")
    buffers = InputBuffers(16384, 512, 4096 // 16, 16, device)  # as the engine keeps them
    t = {"schedule": 0.0, "prepare_inputs": 0.0, "sampler": 0.0, "advance+resolve": 0.0}
    for _ in range(args.steps):
        t0 = time.perf_counter()
        batch = sched.schedule()
        t1 = time.perf_counter()
        rows = batch.sampling_seqs
        temps = None
        if args.sampler == "one-pass":  # as StepSampler.one_pass_temperatures
            temps = plain_temperatures(rows)
        else:  # as StepSampler.sample when no row uses penalties
            build_sampling_tensors([s.sampling_params for s in rows], [()] * len(rows),
                                   [range(s.num_output_tokens) for s in rows], set(), 151936,
                                   device)
        t2 = time.perf_counter()
        buffers.prepare(batch, temperatures=temps)
        t3 = time.perf_counter()
        sched.advance(batch)
        sched.resolve(rows, [7] * len(rows))
        t4 = time.perf_counter()
        parts = {"schedule": t1 - t0, "sampler": t2 - t1, "prepare_inputs": t3 - t2,
                 "advance+resolve": t4 - t3}
        for k, dt in parts.items():
            t[k] += dt
    total = sum(t.values())
    print(f"{args.rows} decode rows, {args.steps} steps: {total / args.steps * 1e3:.2f} ms/step")
    for k, v in t.items():
        print(f"  {k:<18}{v / args.steps * 1e3:7.3f} ms")


if __name__ == "__main__":
    main()
