#!/usr/bin/env bash
# One device run: the offline benchmark, the GPU tests and the attention micro-benchmark,
# each under its own time limit. Usage on the GPU machine (repo root):
#   bash scripts/gpu_check.sh [offline.py args...]
# ABLATE="--no-overlap,--enforce-eager" also runs the benchmark once per listed switch
# (comma-separated offline.py flags; peer skipped) and PROFILE=1 runs profile_step.py.
# SKIP_OFFLINE, SKIP_TESTS, SKIP_ATTN leave those parts out; ATTN_ARGS="--fp8" (or --ragged,
# --quick, --splits) picks the attention benchmark's part.
# Logs go to $OUT (or ./gpu-out). Missing pure-Python packages travel as wheels in .whl/
# (git-ignored: name `.whl` in the device tool's carry); the GPU image lacks only `gguf`:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl gguf==0.19.0   (scripts/gpu_serve.sh needs more)
source scripts/device_env.sh
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
if [ -z "$SKIP_OFFLINE" ]; then
  timeout "${OFFLINE_S:-240}" python3 -m benchmarks.offline --out "$OUT/offline.json" "$@" 2>&1 \
    | tee "$OUT/offline.log" | tail -25
fi
if [ -z "$SKIP_TESTS" ]; then
  # TESTS: pytest arguments (default: every test marked gpu, CUDA parametrizations included;
  # tests/server holds none, and its conftest imports openai, which the GPU image lacks;
  # test_kv_events.py holds none and imports msgspec and zmq, which it lacks too)
  # shellcheck disable=SC2086
  # --durations: the slowest tests, where a device session's test time goes
  timeout "${TESTS_S:-560}" python3 -m pytest -q --maxfail=10 -p no:cacheprovider \
    --durations=15 \
    ${TESTS:--m gpu tests/ --ignore=tests/server --ignore=tests/engine/test_kv_events.py} 2>&1 | tee "$OUT/gpu_tests.log" | tail -45
fi
if [ -z "$SKIP_ATTN" ]; then
  # shellcheck disable=SC2086
  timeout "${ATTN_S:-90}" python3 -m benchmarks.attention ${ATTN_ARGS:-} 2>&1 \
    | tee "$OUT/attention.log" | tail -40
fi
IFS=, read -ra ablations <<< "${ABLATE:-}"
for flags in "${ablations[@]}"; do
  name=$(echo "$flags" | tr -cd 'a-z-' | sed 's/^-*//')
  echo "== ablation: $flags"
  # shellcheck disable=SC2086
  timeout "${OFFLINE_S:-240}" python3 -m benchmarks.offline --no-peer $flags \
    --out "$OUT/offline-$name.json" 2>&1 | tee "$OUT/offline-$name.log" | tail -8
done
if [ -n "$PROFILE" ]; then
  # shellcheck disable=SC2086
  timeout "${PROFILE_S:-150}" python3 -m benchmarks.profile_step ${PROFILE_ARGS:-} 2>&1 \
    | tee "$OUT/profile.log" | tail -40
fi
