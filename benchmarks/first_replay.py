"""What a CUDA graph's first replay costs against its later ones, per graph of the decode
ladder: the one-time work the driver does at a graph's first launch, which lands in the
first requests' steps unless start-up replays each graph once
(cuda_graph.REPLAY_AFTER_CAPTURE).

    python -m benchmarks.first_replay [--model DIR] [--kv-cache-dtype fp8] [--replay-at-capture]

Builds an engine with its defaults (the random-weight Qwen3-0.6B unless --model), then
replays every decode graph three times over the reset buffers (no KV writes, contexts 0),
timing each replay to its end on the GPU. Without --replay-at-capture the switch is off, so
the first of the three is the graph's first launch.
"""

import argparse
import time

import torch


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model directory (default: the random Qwen3-0.6B)")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--replay-at-capture", action="store_true",
                    help="leave cuda_graph.REPLAY_AFTER_CAPTURE on (the default engine)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("first_replay needs a CUDA GPU")
    from nanovllm import LLM
    from nanovllm.worker import cuda_graph

    cuda_graph.REPLAY_AFTER_CAPTURE = args.replay_at_capture
    if args.model is None:
        from benchmarks.random_model import qwen3_random_model
        args.model = str(qwen3_random_model())
    llm = LLM(args.model, kv_cache_dtype=args.kv_cache_dtype)
    runner = llm.engine.runner
    ladder = runner.graphs
    runner.buffers.reset()
    times = {}  # size -> [ms of replay 1, 2, 3]
    for size in ladder.sizes:
        times[size] = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            ladder.graphs[size].replay()
            torch.cuda.synchronize()
            times[size].append((time.perf_counter() - t0) * 1e3)
    print(f"replay at capture: {'on' if args.replay_at_capture else 'off'}; "
          f"{len(ladder.sizes)} decode graphs, kv cache {args.kv_cache_dtype}")
    print(f"{'rows':>6} {'1st ms':>8} {'2nd ms':>8} {'3rd ms':>8}")
    for size, t in times.items():
        print(f"{size:>6} {t[0]:8.3f} {t[1]:8.3f} {t[2]:8.3f}")
    total = [sum(t[i] for t in times.values()) for i in range(3)]
    print(f"{'all':>6} {total[0]:8.2f} {total[1]:8.2f} {total[2]:8.2f}  "
          f"(first launches cost {total[0] - total[1]:.1f} ms more than second ones)")


if __name__ == "__main__":
    main()
