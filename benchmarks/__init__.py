"""nano-vLLM's benchmarks: scripts that measure the engine and print figures.

Tests never time anything; these do, and BENCHMARKS.md records what they printed, with the
command, machine and date. Each is a module run from the repository root:

    python -m benchmarks.NAME [--help]

offline (the seed's throughput workload against its speed of light and a peer), serve (the
HTTP server under Poisson load), engine_loop (the server's engine process without HTTP),
cpu (the default model on a CPU), attention (the paged-attention kernels), profile_step
(where a GPU decode step's time goes) and host_overhead (a decode step's bookkeeping). Their
requests come from workloads.py.
"""
