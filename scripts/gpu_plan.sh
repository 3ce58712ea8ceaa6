#!/usr/bin/env bash
# The GPU runbook: the GPU tests and the figures of today's defaults, one stage per device
# call (each fits its 10 minutes). Run from the repository root; logs go to $OUT (or
# ./gpu-out):
#   bash scripts/gpu_plan.sh check      # every test marked gpu (TESTS="pytest args" narrows)
#   bash scripts/gpu_plan.sh bench      # bench.py as written: the seed workload with a bf16
#                                       # and an fp8 KV cache, alternating, ROUNDS (3) fresh
#                                       # processes each after a warm-up run; mean and best
#   bash scripts/gpu_plan.sh serve      # the saturated server against offline LLM.generate,
#                                       # 256 prompts (PROMPTS), two runs of each side
#   bash scripts/gpu_plan.sh profile    # a decode step's kernels by time, bf16 and fp8 caches
#   bash scripts/gpu_plan.sh attention  # the attention kernels against the torch reference
#   bash scripts/gpu_plan.sh tp         # TP=2 against TP=1, Qwen3-8B's shape (two GPUs:
#                                       # nvidia-h200-x2)
#   bash scripts/gpu_plan.sh structured # a JSON-schema constraint on 64 rows against none;
#                                       # first, here: python -m benchmarks.structured_output
#                                       #   --export-tokenizer gpu-assets/tok (untracked: it
#                                       #   travels with the working tree)
# The GPU image lacks some pure-Python packages (gguf; the server's for `serve`): carry them
# as wheels in .whl/ (git-ignored; name `.whl` in the device tool's carry), installed here
# into /tmp/site:
#   pip download --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 -d .whl \
#     gguf==0.19.0 fastapi uvicorn uvloop httptools prometheus_client httpx aiohttp \
#     llguidance==1.9.1 jsonschema
# The default model's package (98 MB) is over the carry limit: the GPU tests that need it
# skip, and benchmarks.structured_output runs a random model with its tokenizer beside it.
set -uo pipefail
stage=${1:?"which stage: check, bench, serve, profile, attention, structured or tp"}
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

offline() {  # offline LABEL DTYPE: one seed-workload run in a fresh process, its tok/s line
  timeout "${OFFLINE_S:-120}" python3 -m benchmarks.offline --no-peer --kv-cache-dtype "$2" \
    2>&1 | grep -E "^nano-vLLM  " | sed "s/^/$1 $2: /" | tee -a "$OUT/bench.log"
}

case "$stage" in
  check)
    # tests/server (openai) and test_kv_events.py (msgspec, zmq) need packages the image
    # lacks and hold no GPU test
    # shellcheck disable=SC2086
    timeout "${TESTS_S:-560}" python3 -m pytest -q --maxfail=10 -p no:cacheprovider \
      --durations=15 ${TESTS:--m gpu tests/ --ignore=tests/server \
      --ignore=tests/engine/test_kv_events.py} 2>&1 | tee "$OUT/gpu_tests.log" | tail -40 ;;
  bench)
    # the first run of a call comes out low (a cold host): it is not counted
    offline warm-up fp8 >/dev/null
    : > "$OUT/bench.log"
    for round in $(seq "${ROUNDS:-3}"); do
      offline "round $round" auto
      offline "round $round" fp8
    done
    # $7: the engine row's fourth column, its output tokens/s
    awk '{ gsub(",", "", $7); n[$3]++; s[$3] += $7; if ($7 > b[$3]) b[$3] = $7 }
         END { for (d in n) printf "%s KV cache: mean %.0f, best %.0f tok/s over %d runs\n",
               (d == "auto:" ? "bf16" : "fp8"), s[d] / n[d], b[d], n[d] }' "$OUT/bench.log" ;;
  serve)
    MODEL=$(python3 -m benchmarks.random_model)
    # the waiting queue is bounded far above the workload: throughput, not admission
    timeout "${SERVE_S:-400}" python3 -m benchmarks.serve \
      --launch "--model $MODEL --max-num-seqs 256 --max-model-len 4096 --max-num-waiting 4096" \
      --rates inf,inf --num-prompts "${PROMPTS:-256}" --input-len 512 --output-len 256 \
      --range-ratio 0.5 --client-procs 4 --offline 2 --out "$OUT/serve.json" 2>&1 \
      | tee "$OUT/serve.log" | grep -E "server CPU|engine steps|engine loop|^ +inf|offline|best"
    # the server's own log (start-up, requests, engine lines), also after a timeout
    cp /tmp/nanovllm-serve-*.log "$OUT"/ 2>/dev/null || true ;;
  profile)
    for dtype in auto fp8; do
      timeout 200 python3 -m benchmarks.profile_step --kv-cache-dtype $dtype 2>&1 \
        | tee "$OUT/profile-$dtype.log" | tail -40
    done ;;
  attention)
    timeout 300 python3 -m benchmarks.attention 2>&1 | tee "$OUT/attention.log" | tail -50 ;;
  structured)
    timeout 300 python3 -m benchmarks.structured_output --tokenizer gpu-assets/tok 2>&1 \
      | grep -v -i warn | tee "$OUT/structured.log" | tail -12 ;;
  tp)
    timeout 560 python3 -m benchmarks.tensor_parallel --shape 8b --out "$OUT/tp.json" 2>&1 \
      | grep -v " INFO " | tee "$OUT/tp.log" | tail -12 ;;
  *)
    echo "unknown stage $stage: check, bench, serve, profile, attention, structured or tp" >&2
    exit 2 ;;
esac
