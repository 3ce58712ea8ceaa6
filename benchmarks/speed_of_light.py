"""The speed-of-light time of an offline workload: the bytes it must move and the FLOPs it must
do, against the memory bandwidth and matmul rate measured on the device it runs on.

Counted (per the model's shape and each sequence's prompt length P and output length M):

- KV reads: a decode step of a sequence reads its whole KV context once. The first output token
  comes from prefill; token k = 2..M is decoded over a context of P + k - 1 tokens, so one
  sequence reads sum_k (P + k - 1) = (M - 1) * P + (M - 1) * M / 2 token-KVs, each
  2 (K, V) * layers * kv_heads * head_dim * dtype bytes.
- Weight reads: every step reads all matmul weights once (lm_head included, the embedding
  lookup's few rows not), and there are at least max(M) steps: one token per sequence per step,
  with every sequence running at once (max_num_seqs >= number of sequences).
- Prefill FLOPs: 2 * matmul params per prompt token, plus causal attention
  4 * layers * heads * head_dim * P^2 / 2 per prompt (QK^T and PV, half the square).
- Decode FLOPs: 2 * matmul params per output token. Decode attention is left out: it is
  memory-bound and its cost is already the KV reads above.
- KV writes (one per token, ~0.5% of the KV reads here) are left out.

Three ways to turn that into a time (all printed; the headline is the first):
  serial:    T = (KV + weight bytes) / BW + (prefill + decode FLOPs) / rate
             memory and compute one after the other: the figure the issue's ~34,500 tok/s on an
             H200 comes from (4.3 TB/s, 790 TFLOP/s give 34,000).
  per phase: T = prefill FLOPs / rate + max((KV + weight bytes) / BW, decode FLOPs / rate)
             the roofline max of each phase, prefill then decode (prefill moves next to no bytes
             of its own: its steps' weight reads are among the max(M) counted).
  overlap:   T = max(all bytes / BW, all FLOPs / rate), a strict lower bound.
"""

import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch


@dataclass
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelShape":
        heads = cfg["num_attention_heads"]
        return cls(
            layers=cfg["num_hidden_layers"],
            hidden=cfg["hidden_size"],
            heads=heads,
            kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate=cfg["intermediate_size"],
            vocab=cfg["vocab_size"],
        )

    @property
    def matmul_params(self) -> int:
        """Weights every token multiplies by: attention and MLP projections, and lm_head (tied or
        not, it is one vocab x hidden matrix read per step)."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attn + mlp) + self.vocab * self.hidden

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


@dataclass
class WorkloadCost:
    kv_read_bytes: float
    weight_bytes_per_step: float
    min_steps: int
    weight_read_bytes: float
    prefill_flops: float
    decode_flops: float

    @property
    def total_bytes(self) -> float:
        return self.kv_read_bytes + self.weight_read_bytes


def workload_cost(
    shape: ModelShape, prompt_lens: Sequence[int], max_tokens: Sequence[int], dtype_bytes: int,
    kv_bytes: float | None = None,
) -> WorkloadCost:
    """`kv_bytes`: bytes per cached K or V element when not `dtype_bytes` (an fp8 cache: 1,
    plus its scales' share)."""
    token_kv_reads = sum((m - 1) * p + (m - 1) * m // 2 for p, m in zip(prompt_lens, max_tokens))
    weight_bytes = shape.matmul_params * dtype_bytes
    steps = max(max_tokens)
    attn_per_sq = 4 * shape.layers * shape.heads * shape.head_dim  # FLOPs per (query, key) pair
    prefill = 2 * shape.matmul_params * sum(prompt_lens) + attn_per_sq * sum(
        p * p / 2 for p in prompt_lens
    )
    return WorkloadCost(
        kv_read_bytes=float(token_kv_reads * shape.kv_bytes_per_token(dtype_bytes)
                            * (kv_bytes or dtype_bytes) / dtype_bytes),
        weight_bytes_per_step=float(weight_bytes),
        min_steps=steps,
        weight_read_bytes=float(weight_bytes * steps),
        prefill_flops=float(prefill),
        decode_flops=float(2 * shape.matmul_params * sum(max_tokens)),
    )


def sol_times(cost: WorkloadCost, bandwidth: float, matmul_rate: float) -> dict[str, float]:
    """Seconds under each of the three formulas in this module's docstring."""
    mem = cost.total_bytes / bandwidth
    flops = cost.prefill_flops + cost.decode_flops
    return {
        "serial": mem + flops / matmul_rate,
        "per_phase": cost.prefill_flops / matmul_rate + max(mem, cost.decode_flops / matmul_rate),
        "overlap": max(mem, flops / matmul_rate),
        "memory_s": mem,
        "kv_read_s": cost.kv_read_bytes / bandwidth,
        "weight_read_s": cost.weight_read_bytes / bandwidth,
        "prefill_compute_s": cost.prefill_flops / matmul_rate,
        "decode_compute_s": cost.decode_flops / matmul_rate,
    }


@dataclass
class DeviceRates:
    device: str
    dtype: str
    bandwidth: float  # bytes/s, read + written, of a large device-to-device copy
    copy_bytes: int
    matmul_rate: float  # FLOP/s of an n^3 matmul
    matmul_n: int

    def as_dict(self) -> dict:
        return asdict(self)


def _timed(fn, reps: int, warmup: int, device: torch.device) -> float:
    """Median seconds of `fn` over `reps` runs, each timed alone."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _copy_seconds(nbytes: int, dtype: torch.dtype, device: torch.device) -> float:
    elem = torch.empty(0, dtype=dtype).element_size()
    src = torch.empty(nbytes // elem, dtype=dtype, device=device).fill_(1)
    dst = torch.empty_like(src)
    return _timed(
        lambda: dst.copy_(src), reps=10 if device.type == "cuda" else 5, warmup=3, device=device
    )


def _matmul_seconds(n: int, dtype: torch.dtype, device: torch.device) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    cuda = device.type == "cuda"
    # a GPU needs a few dozen matmuls to reach its steady clock
    return _timed(lambda: a @ b, reps=20 if cuda else 5, warmup=25 if cuda else 2, device=device)


def measure_device(device: torch.device, dtype: torch.dtype) -> DeviceRates:
    """Memory bandwidth and matmul rate, as the engine will see them: the dtype it runs in."""
    cuda = device.type == "cuda"
    # 2 GiB each way on a GPU: far beyond L2, as a KV cache is; CPUs get a smaller, slower test
    copy_bytes = 2 * 2**30 if cuda else 256 * 2**20
    copy_s = _copy_seconds(copy_bytes, dtype, device)
    n = 8192 if cuda else 1024
    mm_s = _matmul_seconds(n, dtype, device)
    if cuda:
        torch.cuda.empty_cache()
        name = torch.cuda.get_device_name(device)
    else:
        name = "cpu"
    return DeviceRates(
        device=name,
        dtype=str(dtype).replace("torch.", ""),
        bandwidth=2 * copy_bytes / copy_s,
        copy_bytes=copy_bytes,
        matmul_rate=2 * n**3 / mm_s,
        matmul_n=n,
    )
