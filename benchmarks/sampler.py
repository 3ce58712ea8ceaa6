"""A decode step's sampling on CUDA: the one-pass Triton samplers (the inverse CDF, the
engine's, and the Gumbel race) against the torch sampler and against the time to read the
logits once at the device's copy bandwidth.

    python -m benchmarks.sampler [--rows 256] [--vocab 151936] [--temperature 0.6]
                                 [--splits 2 4 8]  # vocabulary splits per row to compare
                                                   # with the kernel's own choice

Logits are random bf16 [rows, vocab] (the LM head's output dtype), every row at the same
temperature (0: greedy). Times are medians of CUDA-graph replays
(`triton.testing.do_bench_cudagraph`): the device's time alone. Timed as eager calls, each
sampler took 70-110 us at every row count from 1 to 256 rows: the host's launches, not
the device's work (the engine's device never waits on its host, offline.py --gpu-gaps).
"""

import argparse

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256, 512])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.6, 0.0])
    ap.add_argument("--splits", type=int, nargs="*", default=[],
                    help="also time these vocabulary splits per row (programs = rows x splits)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return
    from benchmarks.speed_of_light import _copy_seconds
    from nanovllm.kernels.triton_cdf_sampling import inverse_cdf_sample
    from nanovllm.kernels.triton_sampling import gumbel_argmax
    from nanovllm.model.layers.sampler import MIN_TEMPERATURE, _gumbel_argmax

    dev = torch.device("cuda")
    copy_bytes = 2 * 2**30
    copy_gbs = 2 * copy_bytes / _copy_seconds(copy_bytes, torch.bfloat16, dev) / 1e9
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {copy_gbs:,.0f} GB/s "
          f"(2 GiB device to device, read + written)")
    print(f"{'rows':>5} {'T':>4} {'cdf us':>8} {'race us':>8} {'race/cdf':>9} {'torch us':>9} "
          f"{'torch/race':>11} {'read-once us':>13} {'of read-once':>13}")
    for rows in args.rows:
        logits = torch.randn(rows, args.vocab, device=dev).to(torch.bfloat16)
        for temp in args.temperature:
            temps = torch.full((rows,), temp, device=dev)
            cdf = _us(inverse_cdf_sample, logits, temps, MIN_TEMPERATURE, seed=1)
            race = _us(gumbel_argmax, logits, temps, MIN_TEMPERATURE, seed=1)
            if temp == 0.0:  # the torch sampler's greedy rows are an argmax
                theirs = _us(torch.argmax, logits, -1)
            else:  # its logits are float32 by then
                theirs = _us(lambda x, t: _gumbel_argmax(x.float(), t), logits, temps)
            floor = logits.numel() * logits.element_size() / copy_gbs / 1e3
            print(f"{rows:>5} {temp:>4} {cdf:>8.1f} {race:>8.1f} {race / cdf:>8.2f}x "
                  f"{theirs:>9.1f} {theirs / race:>10.2f}x {floor:>13.1f} {floor / cdf:>13.2f}")
            for splits in args.splits:
                t = _us(inverse_cdf_sample, logits, temps, MIN_TEMPERATURE, seed=1,
                        num_splits=splits)
                print(f"{'':>5} {'':>4} {t:>8.1f}  ({splits} splits: {t / cdf:.2f} of the "
                      f"cdf kernel's own choice)")


def _us(fn, *args, **kwargs) -> float:
    """Median microseconds of fn(*args, **kwargs) replayed in a CUDA graph."""
    import triton

    return triton.testing.do_bench_cudagraph(lambda: fn(*args, **kwargs)) * 1e3


if __name__ == "__main__":
    main()
