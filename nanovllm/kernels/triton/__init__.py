"""The CUDA backend in Triton (on a CPU, tests run it in Triton's interpreter), one file an
idea, each importing only those below it:

- `attention.py`: `paged_attention` and `store_kv`, the backend's face (the contract is
  torch_attention's); it sends a step's rows of one query token to `decode.py` (KV splits
  and their reduce, the rows started longest first) and the others to `prefill.py`.
- `kv_store.py`: K/V into the paged cache (fp8 bytes and scales, a transposed V by runs),
  alone or fused with `ops.py`'s RoPE (`qk_norm_rope_store`).
- `tiles.py`: what both attention kernels share: a cache's flags, its tiles' loads
  (fp8 converted in registers) and one online-softmax step.
- `ops.py`: RMSNorm (fused with the residual add), q/k norm + RoPE, SiLU-and-mul.
- `linear.py`: projections of few rows as split-K partials, which `ops.add_rms_norm` sums.
- `sampling.py`: greedy and plain-temperature rows drawn by the inverse CDF in one pass.
- `launch.py`: programmatic dependent launches and the GPU's multiprocessor count.
"""
