#!/usr/bin/env bash
# One device run of the serving benchmark on the random-weight Qwen3-0.6B: Poisson rates,
# then the same prompts offline. Usage on the GPU machine (repo root):
#   bash scripts/gpu_serve.sh [serve.py args...]
# The waiting queue is bounded far above the workloads (throughput, not admission, is
# measured); LAUNCH_EXTRA adds `nanovllm serve` options. ENGINE_LOOP="--num-prompts 1024
# --rounds 2" first runs benchmarks/engine_loop.py (no HTTP) on the same model; SKIP_SERVE=1
# stops after it.
# The GPU image lacks the server's packages: carry them as wheels in .whl/ (git-ignored):
#   pip download --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
#     gguf==0.19.0 fastapi uvicorn uvloop httptools prometheus_client httpx aiohttp
# (aiohttp: the benchmark's default client; add --platform manylinux_2_28_x86_64 for its
# wheels)
source scripts/device_env.sh
MODEL=$(python3 -m benchmarks.random_model)
if [ -n "$ENGINE_LOOP" ]; then
  # the engine process without HTTP vs LLM.generate; ENGINE_LOOP holds engine_loop.py args
  # shellcheck disable=SC2086
  timeout "${ENGINE_LOOP_S:-300}" python3 -m benchmarks.engine_loop --model "$MODEL" \
    --vocab-limit 150000 $ENGINE_LOOP 2>&1 | grep -v " INFO " | tee "$OUT/engine_loop.log"
fi
[ -n "$SKIP_SERVE" ] && exit 0
timeout "${SERVE_S:-400}" python3 -m benchmarks.serve \
  --launch "--model $MODEL --max-num-seqs 256 --max-model-len 4096 --max-num-waiting 4096 \
  ${LAUNCH_EXTRA:-}" --offline \
  --out "$OUT/serve_h200.json" "$@" 2>&1 | tee "$OUT/serve.log" | tail -40
# the server's own log (start-up, per-request lines, engine lines), also after a timeout
cp /tmp/nanovllm-serve-*.log "$OUT"/ 2>/dev/null || true
