"""KV beyond the device: the host prefix cache against none, and swap against recompute.

    python -m benchmarks.kv_tiers --shape 8b            # Qwen3-8B's shape, random bf16 weights
    python -m benchmarks.kv_tiers --shape 0.6b --out kv.json
    python -m benchmarks.kv_tiers --shape tiny --docs 4 --doc-len 256 --requests 16 \
        --burst 8 --low 2 --low-len 512                  # a CPU smoke run of the same code

Three experiments, each run side by side in one process (a fresh engine per run; --only
picks one), on blocks of 16 tokens:

- prefix: --docs documents of --doc-len tokens; --requests requests, each one document (drawn
  at random, the same draw for both runs) plus a distinct 32-token question, 16 output
  tokens; the device KV cache holds about --device-docs documents.
  Without a host tier a document evicted from the device is recomputed; with
  `cpu_offload_gib` (sized for every document) it is copied back. The requests arrive at
  each of --rates (Poisson, requests/s; 0: all at once); TTFT is from a request's arrival
  to its first token.
- burst: --burst prompts of --doc-len unique tokens, 256 output tokens each, on
  a cache that holds a quarter of the prompts but not their outputs; admission_headroom=0,
  so the burst is admitted and preempted (the case the headroom avoids): preemption_mode
  recompute against swap (and auto, the cost policy), and the seed's recompute (prefix
  caching off: a victim's blocks are thrown away, not left cached on the device). Greedy
  outputs of recompute and swap are compared.
- priority: --low requests of --low-len tokens (256 output tokens) at priority 1 run on a
  cache that holds them to their end; once each has its first token, as many priority-0
  requests of the same length (32 output tokens) arrive, preempt them all and take their
  blocks; the low ones then resume by recomputing their whole context, or by copying it back
  (swap); --repeat runs of each, alternating.

Figures: output tokens/s, TTFT p50/p90, prefix-hit blocks by tier, preemptions and swaps.
"""

import argparse
import gc
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.random_model import build_random_model, shape_config
from nanovllm import SamplingParams
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.worker.kv_cache import KVFormat, kv_bytes_per_token

BLOCK_SIZE = 16
QUESTION_LEN = 32  # prefix: the tokens of each request's own question after its document
PREFIX_TOKENS = 16  # prefix: output tokens of each request
BURST_TOKENS = 256  # burst: output tokens of each prompt
LOW_TOKENS, HIGH_TOKENS = 256, 32  # priority: output tokens of a low and a high request


def run(model: Path, options: dict, prompts: list[list[int]], max_tokens: int,
        rates: tuple[float, ...] = (0.0,)) -> dict:
    """One engine; the prompts streamed at each arrival rate in turn (requests/s, Poisson,
    the same draw for every engine; 0: all at once), each from a cold cache in both tiers.
    Returns {rate: figures and outputs}."""
    engine = warm_engine(model, options, 16)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    results = {}
    for rate in rates:
        gaps = random.Random(1)
        arrivals, t = [], 0.0
        for _ in prompts:
            arrivals.append(t)
            t += gaps.expovariate(rate) if rate else 0.0
        results[rate] = _timed(engine, prompts, arrivals, params)
        results[rate]["options"] = options
        results[rate]["rate"] = rate
    cost = engine.runner.preemption_cost
    for r in results.values():
        r["copy_gb_s"] = cost.copy_bytes_per_s / 1e9 if cost else None
    dispose(engine)
    return results


def warm_engine(model: Path, options: dict, warm_len: int) -> LLMEngine:
    """A fresh engine that has run one `warm_len`-token prompt (at a workload's full length,
    its prefill kernels compile here, not in the timed run)."""
    engine = LLMEngine(str(model), **options)
    engine.add_request([5] * warm_len, SamplingParams(temperature=0, max_tokens=4))
    while engine.has_unfinished_requests():
        engine.step()
    return engine


def dispose(engine: LLMEngine) -> None:
    """Free an engine's device memory before the next one starts."""
    engine.runner = engine.block_manager = engine.scheduler = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _timed(engine: LLMEngine, prompts, arrivals: list[float], params) -> dict:
    assert engine.block_manager.reset_prefix_cache()
    events0 = dict(engine.block_manager.events)
    preempted0, swaps0 = engine.scheduler.num_preemptions, engine.scheduler.num_swaps
    start = time.perf_counter()
    arrived: dict[str, float] = {}
    first: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    rids: list[str] = []
    while len(rids) < len(prompts) or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while len(rids) < len(prompts) and arrivals[len(rids)] <= now:
            rid = engine.add_request(prompts[len(rids)], params, stream=True, delta=True,
                                     detokenize=False)
            rids.append(rid)
            arrived[rid], tokens[rid] = arrivals[len(rids) - 1], []
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[len(rids)] - now))
            continue
        for out in engine.step():
            new = out.outputs[0].token_ids if out.outputs else []
            if new and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - start - arrived[out.request_id]
            tokens[out.request_id] += new
    wall = time.perf_counter() - start
    ttft = sorted(first.values())
    events = {k: v - events0[k] for k, v in engine.block_manager.events.items()}
    return {
        "wall_s": wall,
        "output_tok_s": sum(len(t) for t in tokens.values()) / wall,
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))],
        "preemptions": engine.scheduler.num_preemptions - preempted0,
        "swaps": engine.scheduler.num_swaps - swaps0,
        "blocks": events,
        "num_kv_blocks": engine.config.num_kv_blocks,
        "num_host_blocks": engine.config.num_host_blocks,
        "outputs": [tokens[r] for r in rids],
    }


def run_priority(model: Path, options: dict, lows: list[list[int]], highs: list[list[int]],
                 low_tokens: int, high_tokens: int) -> dict:
    """Long low-priority requests run; once each has its first token a burst of
    high-priority ones arrives, preempts them all and takes their blocks; the low ones
    then resume: by recomputing their context or by copying it back."""
    engine = warm_engine(model, options, len(lows[0]))
    assert engine.block_manager.reset_prefix_cache()
    low_p = SamplingParams(temperature=0, max_tokens=low_tokens, ignore_eos=True)
    high_p = SamplingParams(temperature=0, max_tokens=high_tokens, ignore_eos=True)
    start = time.perf_counter()
    low_ids = [engine.add_request(p, low_p, stream=True, delta=True, detokenize=False,
                                  priority=1) for p in lows]
    tokens: dict[str, list[int]] = {r: [] for r in low_ids}
    done: dict[str, float] = {}
    burst_at = None
    while engine.has_unfinished_requests() or burst_at is None:
        if burst_at is None and all(tokens[r] for r in low_ids):
            burst_at = time.perf_counter() - start
            for p in highs:
                rid = engine.add_request(p, high_p, stream=True, delta=True, detokenize=False)
                tokens[rid] = []
        for out in engine.step():
            tokens[out.request_id] += out.outputs[0].token_ids if out.outputs else []
            if out.finished:
                done[out.request_id] = time.perf_counter() - start
    wall = time.perf_counter() - start
    sched = engine.scheduler
    result = {
        "options": options, "wall_s": wall, "burst_at_s": burst_at,
        "output_tok_s": sum(len(t) for t in tokens.values()) / wall,
        "low_done_s": max(done[r] for r in low_ids),
        "preemptions": sched.num_preemptions, "swaps": sched.num_swaps,
        "blocks": dict(engine.block_manager.events),
        "outputs": [tokens[r] for r in low_ids],
        "copy_gb_s": engine.runner.preemption_cost.copy_bytes_per_s / 1e9
        if engine.runner.preemption_cost else None,
    }
    dispose(engine)
    return result


def summary(name: str, r: dict) -> str:
    b = r["blocks"]
    return (f"  {name:<22} {r['output_tok_s']:>9,.0f} tok/s  TTFT p50 {r['ttft_p50_s']:7.3f} s "
            f"p90 {r['ttft_p90_s']:7.3f} s  hits device {b['hit_device']:>6} "
            f"host {b['hit_host']:>6}  offloaded {b['offloaded']:>6}  preempted "
            f"{r['preemptions']} (swap {r['swaps']}, blocks out {b['swapped_out']} "
            f"in {b['swapped_in']})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=("8b", "0.6b", "tiny"), default="8b")
    ap.add_argument("--docs", type=int, default=64)
    ap.add_argument("--doc-len", type=int, default=4096)
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--device-docs", type=int, default=8,
                    help="prefix: the device KV cache holds about this many requests")
    ap.add_argument("--rates", default="0",
                    help="prefix: arrival rates to run, requests/s, comma-separated (0: all at "
                    "once)")
    ap.add_argument("--burst", type=int, default=64)
    ap.add_argument("--low", type=int, default=8, help="priority: long low-priority requests")
    ap.add_argument("--low-len", type=int, default=16384)
    ap.add_argument("--repeat", type=int, default=1,
                    help="priority: runs of each configuration, alternating; means compared")
    ap.add_argument("--only", choices=("prefix", "burst", "priority"), default=None)
    ap.add_argument("--out", help="write every figure to this JSON file")
    args = ap.parse_args()

    cfg = shape_config(args.shape)
    model_dir = Path(tempfile.gettempdir()) / f"nanovllm-{args.shape}"
    model, built = build_random_model(cfg, model_dir)
    dtype = getattr(torch, cfg["torch_dtype"])
    per_token = kv_bytes_per_token_of(cfg, dtype)
    rng = random.Random(0)
    vocab = cfg["vocab_size"] - 1000
    bs = BLOCK_SIZE
    report = {"shape": args.shape, "kv_bytes_per_token": per_token,
              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    print(f"{args.shape}: {per_token / 1024:.0f} KiB of KV a token; a {args.doc_len}-token "
          f"document is {args.doc_len * per_token / 2**20:.0f} MiB")

    if args.only in (None, "prefix"):
        docs = [[rng.randrange(vocab) for _ in range(args.doc_len)] for _ in range(args.docs)]
        picks = [rng.randrange(args.docs) for _ in range(args.requests)]
        prompts = [docs[d] + [rng.randrange(vocab) for _ in range(QUESTION_LEN)]
                   for d in picks]
        req_len = args.doc_len + QUESTION_LEN + PREFIX_TOKENS
        blocks = args.device_docs * -(-req_len // bs)
        host_gib = 1.1 * args.docs * args.doc_len * per_token / 2**30
        base = dict(num_kv_blocks=blocks, block_size=bs, swap_space=0,
                    max_model_len=-(-req_len // bs) * bs)
        rates = tuple(float(r) for r in args.rates.split(","))
        off_runs = run(model, base, prompts, PREFIX_TOKENS, rates)
        on_runs = run(model, dict(base, cpu_offload_gib=host_gib), prompts, PREFIX_TOKENS,
                      rates)
        print(f"prefix: {args.requests} requests over {args.docs} documents of "
              f"{args.doc_len} tokens; device KV {blocks} blocks of {bs} "
              f"(~{args.device_docs} requests), host tier {host_gib:.1f} GiB")
        report["prefix"] = {}
        for rate in rates:
            off, on = off_runs[rate], on_runs[rate]
            print(f" arrivals: {'all at once' if not rate else f'{rate:g} requests/s'}")
            print(summary("device only", off))
            print(summary("host prefix cache", on))
            gain = on["output_tok_s"] / off["output_tok_s"]
            print(f"  host cache / device only: throughput {gain:.2f}x, "
                  f"TTFT p50 {off['ttft_p50_s'] / on['ttft_p50_s']:.2f}x lower, "
                  f"p90 {off['ttft_p90_s'] / on['ttft_p90_s']:.2f}x lower")
            report["prefix"][str(rate)] = {
                name: {k: v for k, v in r.items() if k != "outputs"}
                for name, r in (("device only", off), ("host prefix cache", on))}

    if args.only in (None, "burst"):
        prompts = [[rng.randrange(vocab) for _ in range(args.doc_len)] for _ in range(args.burst)]
        req_len = args.doc_len + BURST_TOKENS
        # room for a quarter of the prompts, not for their outputs: decoding preempts
        blocks = max(1, args.burst // 4) * -(-args.doc_len // bs) + 1
        swap_gib = 1.1 * args.burst * req_len * per_token / 2**30
        base = dict(num_kv_blocks=blocks, block_size=bs, admission_headroom=0,
                    max_model_len=-(-req_len // bs) * bs)
        runs = {
            # the seed's preemption: every block of a victim thrown away
            "recompute, no prefix cache": run(
                model, dict(base, swap_space=0, enable_prefix_caching=False), prompts,
                BURST_TOKENS)[0.0],
            # a victim's blocks stay cached on the device until reused
            "recompute": run(model, dict(base, swap_space=0, preemption_mode="recompute"),
                             prompts, BURST_TOKENS)[0.0],
            "swap": run(model, dict(base, swap_space=swap_gib, preemption_mode="swap"),
                        prompts, BURST_TOKENS)[0.0],
            "auto": run(model, dict(base, swap_space=swap_gib), prompts,
                        BURST_TOKENS)[0.0],
        }
        print(f"burst: {args.burst} prompts of {args.doc_len} tokens, {BURST_TOKENS} "
              f"output tokens each; device KV {blocks} blocks of {bs} "
              f"(~{max(1, args.burst // 4)} requests), swap space {swap_gib:.1f} GiB")
        for name, r in runs.items():
            print(summary(name, r))
        rec, swp = runs["recompute"], runs["swap"]
        same = sum(a == b for a, b in zip(rec["outputs"], swp["outputs"]))
        seed = runs["recompute, no prefix cache"]
        print(f"  swap / recompute: throughput {swp['output_tok_s'] / rec['output_tok_s']:.2f}x "
              f"(/ recompute without prefix cache "
              f"{swp['output_tok_s'] / seed['output_tok_s']:.2f}x); identical greedy outputs "
              f"{same} of {args.burst}")
        report["burst"] = {k: {kk: vv for kk, vv in v.items() if kk != "outputs"}
                           for k, v in runs.items()}
        report["burst"]["identical_outputs"] = same
    if args.only in (None, "priority"):
        lows = [[rng.randrange(vocab) for _ in range(args.low_len)] for _ in range(args.low)]
        highs = [[rng.randrange(vocab) for _ in range(args.low_len)] for _ in range(args.low)]
        req_len = args.low_len + LOW_TOKENS
        # room for the low requests to their end; the high burst needs all of it
        blocks = args.low * -(-req_len // bs)
        swap_gib = 1.1 * args.low * req_len * per_token / 2**30
        base = dict(num_kv_blocks=blocks, block_size=bs, max_model_len=-(-req_len // bs) * bs,
                    max_num_batched_tokens=max(16384, args.low_len))
        configs = {
            "recompute": dict(base, swap_space=0),
            "swap": dict(base, swap_space=swap_gib, preemption_mode="swap"),
            "auto": dict(base, swap_space=swap_gib),
        }
        # alternating: run i of every configuration before run i + 1 of any, each round
        # starting one configuration later (on the H200 the third engine of a process ran
        # 4-5% faster than the second, which made the same decisions)
        names = list(configs)
        order = [names[(i + j) % len(names)] for i in range(args.repeat)
                 for j in range(len(names))]
        every = [(name, run_priority(model, configs[name], lows, highs, LOW_TOKENS,
                                     HIGH_TOKENS)) for name in order]
        print(f"priority: {args.low} low-priority requests of {args.low_len} tokens "
              f"({LOW_TOKENS} output tokens), then {args.low} high-priority ones of "
              f"{args.low_len} tokens ({HIGH_TOKENS} output tokens); device KV {blocks} "
              f"blocks of {bs}, swap space {swap_gib:.1f} GiB")
        for name, r in every:
            b = r["blocks"]
            print(f"  {name:<12} {r['output_tok_s']:>8,.0f} tok/s  wall {r['wall_s']:6.2f} s  "
                  f"low-priority done at {r['low_done_s']:6.2f} s  preempted "
                  f"{r['preemptions']} (swap {r['swaps']}, blocks out {b['swapped_out']} in "
                  f"{b['swapped_in']})  copies {r['copy_gb_s'] or 0:.1f} GB/s")
        mean = {name: statistics.mean(r["output_tok_s"] for n, r in every if n == name)
                for name in configs}
        runs = {}
        for name, r in every:  # the first run of each, for outputs
            runs.setdefault(name, r)
        if args.repeat > 1:
            print(f"  means of {args.repeat} runs: " + ", ".join(
                f"{name} {v:,.0f}" for name, v in mean.items()) + " tok/s")
        print(f"  by the means: swap / recompute {mean['swap'] / mean['recompute']:.2f}x, "
              f"auto / recompute {mean['auto'] / mean['recompute']:.2f}x")
        rec, swp = runs["recompute"], runs["swap"]
        same = sum(a == b for a, b in zip(rec["outputs"], swp["outputs"]))
        print(f"  first runs: low-priority work done {rec['low_done_s'] / swp['low_done_s']:.2f}x "
              f"sooner with swap; identical greedy outputs of swap and recompute {same} of "
              f"{args.low}")
        report["priority"] = {k: {kk: vv for kk, vv in v.items() if kk != "outputs"}
                              for k, v in runs.items()}
        report["priority"]["mean_output_tok_s"] = mean
        report["priority"]["identical_outputs"] = same
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


def kv_bytes_per_token_of(cfg: dict, dtype: torch.dtype) -> int:
    from nanovllm.model.config import ModelConfig

    model = ModelConfig.from_hf(cfg)
    return kv_bytes_per_token(model, KVFormat(dtype, model.head_dim))


if __name__ == "__main__":
    main()
