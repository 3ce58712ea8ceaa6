"""nano-vLLM's benchmarks: scripts that measure the engine and print figures.

Tests never time anything; these do, and BENCHMARKS.md records what they printed, with the
command, machine and date. Each is a module run from the repository root:

    python -m benchmarks.NAME [--help]

offline (the seed's bench.py workload against its speed of light and transformers), serve
(the HTTP server under Poisson load, and against offline), cpu_peer (the default model on a
CPU against llama.cpp), kv_tiers (the host prefix cache and swap), router (sglang-router in
front of servers), tensor_parallel (TP=N against TP=1), attention (the paged-attention
kernels against the torch reference), profile_step (where a GPU step's time goes),
kv_accuracy and quant_accuracy (what an fp8 KV cache and packed weights cost in accuracy).
Their requests come from workloads.py, their random-weight models from random_model.py.
"""
