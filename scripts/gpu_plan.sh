#!/usr/bin/env bash
# The measurements still open for issues 11 and 12, in stages that each fit one device call
# (10 minutes; SERVE_FLAGS, PROMPTS, CLIENT_PROCS, CLIENT_FLAGS, RATES, OFFLINE_RUNS and
# SERVE_S shape the serve stage: more runs of each side tell a few percent from a host's noise). Run
# from the repository root (carry `.whl`: it holds the server's wheels, see gpu_serve.sh),
# one stage per call; tp and dp need `nvidia-h200-x2`, the others one GPU:
#   bash scripts/gpu_plan.sh tests    # every GPU test, two-GPU tensor parallelism included;
#                                     # PART=engine, then PART=kernels: one call each
#   bash scripts/gpu_plan.sh kernels  # attention: fp8 layouts vs bf16, ragged decode vs copy
#                                     # bandwidth; the seed workload with bf16 and fp8 caches
#   bash scripts/gpu_plan.sh profile  # a decode step's kernels by time, bf16 and fp8 caches
#   bash scripts/gpu_plan.sh tp       # TP=1 vs TP=2 (NCCL, symmetric-memory all-reduce), 8B
#   bash scripts/gpu_plan.sh serve    # saturated server vs offline: one front end, the
#                                     # defaults (two), --mixed-graphs (steps, engine loop
#                                     # phases, CPU per process)
#   bash scripts/gpu_plan.sh dp       # DP=1 vs DP=2, two and four front ends, 2,048 prompts
#   bash scripts/gpu_plan.sh store    # the K/V store per cache format (benchmarks/kv_store.py),
#                                     # warm, then decode steps with the L2 cleared (--cold),
#                                     # then the seed workload, fp8 and bf16 caches
#   bash scripts/gpu_plan.sh mixedlat # latency at Poisson rates below saturation, eager mixed
#                                     # steps against --mixed-graphs (ITL and TPOT percentiles)
#   bash scripts/gpu_plan.sh fp8attn  # fp8_attention: its GPU tests, its decode kernel against
#                                     # the engine's, the seed workload with off / q / qp, a
#                                     # decode step's profile
#   bash scripts/gpu_plan.sh fp8prefill # the fp8 cache's prefill tiles, the engine's and
#                                     # fp8_attention's (benchmarks/attention.py --prefill --fp8)
#   bash scripts/gpu_plan.sh buffers  # both caches' decode with K/V tiles double- and triple-
#                                     # buffered (benchmarks/attention.py --decode-buffers)
#   FP8_TILE=64,4,7,128 bash scripts/gpu_plan.sh tiles  (or BF16_TILE=32,4,5)
#                                     # the seed workload, the cache's default decode tiles
#                                     # against the given ones (offline.py --decode-tile),
#                                     # alternating, two runs each (~60 s a run: one cache a
#                                     # call fits the 10 minutes)
#   bash scripts/gpu_plan.sh splitk   # split-K o_proj/down_proj: their GPU tests and the GPU
#                                     # engine's greedy tests, then the seed workload with
#                                     # them (the default) against --no-split-k, alternating,
#                                     # fp8 and bf16 caches
#   bash scripts/gpu_plan.sh klayout  # an fp8 K cache head-major in each block
#                                     # (kv_cache.FP8_K_HEAD_MAJOR, switched on in the tree
#                                     # on the device): the fp8 GPU tests with it, then the
#                                     # seed workload (its store included) alternating
#                                     # head-major and position-major, twice (KLAYOUT_FLAGS:
#                                     # offline.py flags for both, e.g. --decode-group-rows 2)
#   bash scripts/gpu_plan.sh grouprows # the decode's dots over the GQA group's heads only:
#                                     # benchmarks/attention.py --group-rows (SKIP_TABLE=1
#                                     # skips it), then the seed workload with FP8_FLAGS /
#                                     # BF16_FLAGS (default --decode-group-rows 16, the old
#                                     # default; e.g. --decode-tile 64,4,3) against the defaults,
#                                     # alternating, ROUNDS times (1)
#   bash scripts/gpu_plan.sh skippast # an fp8 cache's last tiles read to the context's end
#                                     # (triton_decode.SKIP_PAST_END): the fp8 GPU tests
#                                     # (SKIP_TESTS=1 skips them), attention.py --skip-past
#                                     # (SKIP_TABLE=1 skips it), then the seed workload, fp8,
#                                     # against --read-whole-tiles (and with ARGSORT=1
#                                     # --argsort-order), alternating, ROUNDS (1)
#   bash scripts/gpu_plan.sh rounds   # the defaults' figures: the seed workload, fp8 and bf16
#                                     # (bench.py as written) alternating, ROUNDS (5), after an
#                                     # fp8 warm-up run; TESTS="pytest paths" runs those GPU
#                                     # tests first
#   bash scripts/gpu_plan.sh smallgemm # qkv and gate_up at few rows by Triton under PDL
#                                     # (triton_linear.SMALL_GEMMS, on): their GPU tests
#                                     # (SKIP_TESTS=1 skips them), blas.py --chain (norm ->
#                                     # projection -> SiLU, cuBLAS against small_linear;
#                                     # SWEEP=1: and a tile sweep; SKIP_CHAIN=1 skips it), a
#                                     # 32-row step's kernels each way (SKIP_PROFILE=1 skips
#                                     # it), then the seed workload, DTYPES (fp8), defaults
#                                     # against VARIANTS ('|' between flag sets:
#                                     # --no-small-gemms), alternating, ROUNDS (2), after a
#                                     # warm-up
#   bash scripts/gpu_plan.sh fp8splits # the fp8 decode's KV splits at small batches
#                                     # (attention.py --fp8-splits), then the seed workload,
#                                     # fp8, defaults against --decode-programs-per-sm PER_SM
#                                     # (8), alternating, ROUNDS (2), after a warm-up run
#   bash scripts/gpu_plan.sh firstrun # as the first call on a fresh machine: the seed workload
#                                     # as a new user's first bench.py meets it, bf16 then fp8,
#                                     # each process three timed runs (--repeat 3), each cache
#                                     # twice: is the first run of a call low (BENCHMARKS.md,
#                                     # ninth session) inside its process, or only the first
#                                     # process?
#   bash scripts/gpu_plan.sh pdl      # the step's Triton kernels as programmatic dependent
#                                     # launches (kernels/triton_pdl.py PDL, on): the GPU
#                                     # engine and kernel tests (SKIP_TESTS=1 skips them),
#                                     # then the seed workload, fp8 and bf16 (DTYPES), the
#                                     # defaults against --no-pdl, alternating, ROUNDS (2),
#                                     # after a warm-up run
#   bash scripts/gpu_plan.sh fresh    # every process as a new user's first: each with an empty
#                                     # Triton cache, the seed workload, DTYPE (fp8), the
#                                     # defaults against --gc-freeze, alternating, ROUNDS (3)
#   bash scripts/gpu_plan.sh layouts  # an fp8 K's scales in a plane (kv_cache.
#                                     # FP8_K_SCALE_PLANE) and a prefill's V stored by runs
#                                     # (triton_kv_store.RUN_STORES), both on by default: the
#                                     # GPU tests, the store (kv_store.py, warm, cold, prefill
#                                     # by token and by runs) and the decode over each K
#                                     # layout, then the seed workload, fp8, defaults /
#                                     # --no-k-scale-plane / --no-run-stores / both off,
#                                     # alternating, ROUNDS (2), after a warm-up run
#                                     # (SKIP_TESTS=1, SKIP_KERNELS=1 skip parts; PROFILE=1
#                                     # adds a decode step's kernels under each K layout)
#   bash scripts/gpu_plan.sh mallocs  # where the seed workload's first timed run makes its
#                                     # device mallocs (offline.py --malloc-trace, fp8; that run
#                                     # is ~1% slower than a second one, and makes six)
#   bash scripts/gpu_plan.sh gaps     # the device's idle time between the seed workload's
#                                     # steps, by kind of step (offline.py --gpu-gaps), fp8
#                                     # twice (the first a warm-up) and bf16
#   bash scripts/gpu_plan.sh sampler  # the samplers' GPU tests and kernel times, then the seed
#                                     # workload, fp8, alternating ROUNDS (2) of the defaults
#                                     # and --gumbel-sampler after a warm-up run; VARIANTS
#                                     # ("|--gumbel-sampler": flag sets split by |) for others
#   bash scripts/gpu_plan.sh contexts # the fp8 decode over an engine step's contexts by rows
#                                     # and context length, then the fp8 prefill's tiles
#   bash scripts/gpu_plan.sh vapart   # each token's V stored from a program of its own in the
#                                     # fused RoPE + store: GPU tests, kv_store.py both ways
#                                     # (warm and --cold), the seed workload alternating
#                                     # ROUNDS (3) of the defaults and --v-with-k
#   bash scripts/gpu_plan.sh runheads # a complete run's V heads stored one a program by its first
#                                     # tokens' programs (triton_kv_store.RUN_HEADS, on):
#                                     # kv_store.py as the defaults and --no-run-heads
#                                     # (decode 256, prefill 256 and 16,384; warm and --cold),
#                                     # then the seed workload, fp8, alternating ROUNDS (0)
#                                     # of the defaults and --no-run-heads after a warm-up
#                                     # run, then the GPU tests (both ways; SKIP_TESTS=1)
#   bash scripts/gpu_plan.sh freshkv  # kv_store.py with --v-apart-all (SKIP_STORE=1 skips
#                                     # it), then an fp8 cache's prefill rows reading their
#                                     # own positions from the step's K/V (kernels.
#                                     # FRESH_PREFILL, on): its GPU tests (SKIP_TESTS=1),
#                                     # attention.py --fresh (SKIP_TABLE=1), then the seed
#                                     # workload, DTYPES (fp8), alternating ROUNDS (0) of the
#                                     # defaults and --no-fresh-prefill after a warm-up run
#                                     # (2026-12-02: ROUNDS=8 took 304 s)
#   bash scripts/gpu_plan.sh syncs    # where the seed workload's host waits on the GPU (torch's
#                                     # sync debug mode) and the CUDA allocator's mallocs,
#                                     # frees and retries, bf16 and fp8 caches
#   bash scripts/gpu_plan.sh swap     # the host tier's copies (GPU tests), then issue 13's
#                                     # priority burst on the 8B shape, twice, alternating
#                                     # recompute / swap / auto / auto waiting for its copies,
#                                     # each round in a rotated order
# Logs go to $OUT (or ./gpu-out).
set -u
stage=${1:?"which stage: tests, kernels, profile, tp, serve, dp, store, mixedlat, fp8attn, fp8prefill, buffers, splitk, klayout, grouprows, skippast, fp8splits, firstrun, pdl, fresh, layouts, tiles, mallocs, gaps, sampler, syncs or swap"}
source scripts/device_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
model() {  # the random-weight Qwen3-0.6B the serving benchmarks share
  python3 -m benchmarks.random_model
}
offline() {  # offline LOG LABEL DTYPE [FLAGS...]: one seed-workload run (every timed run's
  # line) into $OUT/LOG, each line labelled
  local log=$1 label=$2 dtype=$3
  shift 3
  timeout "${OFFLINE_S:-90}" python3 -m benchmarks.offline --no-peer --kv-cache-dtype "$dtype" \
    "$@" 2>&1 | grep -E "^nano-vLLM  |run [0-9]" | sed "s/^/$label: /" | tee -a "$OUT/$log"
}
store_ab() {  # store_ab LOG FLAGS...: kv_store.py's decode and prefill steps, warm then
  # --cold, once with each of FLAGS (one flag or none, ""), into $OUT/LOG, each line labelled
  local log=$1 cold flags
  shift
  for cold in "" "--cold"; do
    for flags in "$@"; do
      # shellcheck disable=SC2086
      timeout 100 python3 -m benchmarks.kv_store --tokens 256 16384 --pattern decode prefill \
        $cold $flags 2>&1 | grep -E "bf16|V_T" | sed "s/^/${flags:-defaults}${cold:+ cold}: /" \
        | tee -a "$OUT/$log"
    done
  done
}
case "$stage" in
  tests)  # PART=engine (tests/engine, tests/worker) or kernels (tests/model): the whole
    # suite outgrew one call (2026-12-02: 97% of it in 540 s), so one part a call
    case "${PART:-}" in
      engine) dirs="tests/engine tests/worker" ;;
      kernels) dirs="tests/model" ;;
      *) dirs="tests" ;;
    esac
    TESTS="-m gpu $dirs --ignore=tests/server --ignore=tests/engine/test_kv_events.py" \
      SKIP_OFFLINE=1 SKIP_ATTN=1 TESTS_S=${TESTS_S:-560} bash scripts/gpu_check.sh ;;
  kernels)
    # blocks of 128: an fp8 cache's on a GPU (engine/resolve.py), 16: a bf16 cache's
    timeout 150 python3 -m benchmarks.attention --fp8 --block-sizes 128 16 2>&1 \
      | tee "$OUT/attention_fp8.log" | tail -45
    timeout 90 python3 -m benchmarks.attention --ragged 2>&1 | tee "$OUT/attention_ragged.log" \
      | tail -16
    for flags in "" "--kv-cache-dtype fp8"; do
      name=offline${flags:+-fp8}
      # shellcheck disable=SC2086
      timeout 150 python3 -m benchmarks.offline --no-peer $flags --out "$OUT/$name.json" 2>&1 \
        | tee "$OUT/$name.log" | tail -12
    done ;;
  profile)
    for dtype in auto fp8; do
      timeout 200 python3 -m benchmarks.profile_step --kv-cache-dtype $dtype 2>&1 \
        | tee "$OUT/profile-$dtype.log" | tail -40
    done ;;
  tp)
    timeout 560 python3 -m benchmarks.tensor_parallel --shape 8b --all-reduce nccl symm_mem \
      --out "$OUT/tp.json" 2>&1 | grep -v " INFO " | tee "$OUT/tp.log" | tail -12 ;;
  serve)
    MODEL=$(model)
    # SERVE_FLAGS (comma-separated flag sets, "none" for the defaults), PROMPTS,
    # CLIENT_PROCS, RATES (e.g. inf,inf,inf,inf) and OFFLINE_RUNS narrow or change the runs
    IFS=, read -ra sets <<< "${SERVE_FLAGS:---api-server-count 1,none,--mixed-graphs}"
    for extra in "${sets[@]}"; do  # none: the defaults, 2 front ends on a GPU
      [ "$extra" = none ] && extra=""
      name=serve${extra:+-$(echo "$extra" | tr -cd 'a-z-' | sed 's/^-*//')}-${PROMPTS:-256}
      echo "== nanovllm serve $extra"
      timeout "${SERVE_S:-170}" python3 -m benchmarks.serve \
        --launch "--model $MODEL --max-num-seqs 256 --max-model-len 4096 --max-num-waiting 4096 $extra" \
        --rates "${RATES:-inf,inf}" --num-prompts "${PROMPTS:-256}" --input-len 512 \
        --output-len 256 --range-ratio 0.5 --client-procs "${CLIENT_PROCS:-4}" --offline \
        --offline-runs "${OFFLINE_RUNS:-2}" ${CLIENT_FLAGS:-} \
        --out "$OUT/$name.json" 2>&1 \
        | grep -E "server CPU|engine steps|engine loop|gc pauses|^ +inf|offline|best" \
        | tee "$OUT/$name.log"
    done ;;
  dp)
    MODEL=$(model)
    for flags in "--data-parallel-size 1" "--data-parallel-size 2" \
                 "--data-parallel-size 2 --api-server-count 4"; do  # default: 2 front ends
      name=dp-$(echo "$flags" | tr -cd '0-9')
      echo "== nanovllm serve $flags"
      timeout 190 python3 -m benchmarks.serve \
        --launch "--model $MODEL --max-num-seqs 256 --max-model-len 4096 --max-num-waiting 4096 $flags" \
        --rates inf,inf --num-prompts 2048 --input-len 512 --output-len 256 --range-ratio 0.5 \
        --client-procs 8 --out "$OUT/$name.json" 2>&1 \
        | grep -E "server CPU|engine steps|engine loop|^ +inf" | tee "$OUT/$name.log"
    done ;;
  store)
    # the K/V store per cache format, a decode and a prefill step's; then the seed workload
    timeout 120 python3 -m benchmarks.kv_store --pattern decode prefill --tokens 256 16384 \
      2>&1 | tee "$OUT/kv_store.log" | tail -9
    # the same decode with the L2 cache cleared first: the engine's steps write evicted sectors
    timeout 120 python3 -m benchmarks.kv_store --cold --tokens 16 256 2048 2>&1 \
      | tee "$OUT/kv_store_cold.log" | tail -14
    for dtype in fp8 auto; do
      timeout 100 python3 -m benchmarks.offline --no-peer --kv-cache-dtype "$dtype" 2>&1 \
        | grep "^nano-vLLM  " | tee -a "$OUT/store.log"
    done ;;
  mixedlat)
    # every arrival below saturation makes a mixed step (its prompt beside the running
    # decodes): eager, one launch per op, unless --mixed-graphs replays a captured graph
    MODEL=$(model)
    for extra in "" "--mixed-graphs"; do
      name=mixedlat${extra:+-graphs}
      echo "== nanovllm serve $extra"
      timeout 250 python3 -m benchmarks.serve \
        --launch "--model $MODEL --max-num-seqs 256 --max-model-len 4096 $extra" \
        --rates 8,32,64 --num-prompts 256 --input-len 512 --output-len 256 --range-ratio 0.5 \
        --client-procs 4 --out "$OUT/$name.json" 2>&1 \
        | grep -E "rate|^ +[0-9]|engine steps" | tee "$OUT/$name.log"
    done ;;
  fp8attn)
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/model/test_triton_fp8_decode.py tests/engine/test_fp8_attention.py 2>&1 \
      | tee "$OUT/fp8attn_tests.log" | tail -3
    timeout 120 python3 -m benchmarks.attention --fp8-decode 2>&1 \
      | tee "$OUT/fp8attn_kernels.log" | tail -60
    for mode in off qp q; do
      timeout 100 python3 -m benchmarks.offline --no-peer --kv-cache-dtype fp8 \
        --fp8-attention $mode --repeat 2 2>&1 | grep -E "^nano-vLLM  |run 2" \
        | sed "s/^/$mode: /" | tee -a "$OUT/fp8attn_offline.log"
    done
    timeout 100 python3 -m benchmarks.profile_step --kv-cache-dtype fp8 --fp8-attention qp \
      2>&1 | grep -E "unprofiled|GPU kernel time|_decode" | tee "$OUT/fp8attn_profile.log" ;;
  fp8prefill)
    # the fp8 cache's prefill tiles, never swept (the bf16 cache's were: a4a7125), and
    # fp8_attention's (128 positions a tile; they spill registers at 128 rows, sm90_ptx)
    timeout 500 python3 -m benchmarks.attention --prefill --fp8 2>&1 \
      | tee "$OUT/fp8_prefill_tiles.log" | tail -100 ;;
  buffers)
    timeout 300 python3 -m benchmarks.attention --decode-buffers 2>&1 \
      | tee "$OUT/decode_buffers.log" | tail -40 ;;
  grouprows)
    [ -n "${SKIP_TABLE:-}" ] || timeout 260 python3 -m benchmarks.attention --group-rows 2>&1 \
      | tee "$OUT/group_rows.log" | tail -60
    for round in $(seq "${ROUNDS:-1}"); do
      for dtype in fp8 auto; do
        if [ "$dtype" = fp8 ]; then ab=${FP8_FLAGS:---decode-group-rows 16}
        else ab=${BF16_FLAGS:---decode-group-rows 16}; fi
        for flags in "" "$ab"; do
          # shellcheck disable=SC2086
          offline group_rows_offline.log "round $round $dtype ${flags:-group rows}" "$dtype" $flags
        done
      done
    done ;;
  skippast)
    [ -n "${SKIP_TESTS:-}" ] || timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/model/test_triton_fp8.py tests/engine/test_fp8_kv.py \
      tests/model/test_triton_attention.py -k "fp8 or longest or transposed or past" 2>&1 \
      | tail -3 | tee "$OUT/skippast_tests.log"
    [ -n "${SKIP_TABLE:-}" ] || timeout 150 python3 -m benchmarks.attention --skip-past 2>&1 \
      | tee "$OUT/skippast_attention.log" | tail -20
    # the first run of a call has come out low (a cold host): one run first, not counted
    offline skippast_offline.log "warm-up, not counted" fp8
    for round in $(seq "${ROUNDS:-1}"); do
      offline skippast_offline.log "round $round skip past end" fp8
      offline skippast_offline.log "round $round whole last tile" fp8 --read-whole-tiles
      [ -z "${ARGSORT:-}" ] || offline skippast_offline.log "round $round argsort order" fp8 \
        --argsort-order
    done ;;
  fp8splits)
    timeout 150 python3 -m benchmarks.attention --fp8-splits 2>&1 \
      | tee "$OUT/fp8splits_attention.log" | tail -32
    offline fp8splits_offline.log "warm-up, not counted" fp8
    for round in $(seq "${ROUNDS:-2}"); do
      offline fp8splits_offline.log "round $round defaults" fp8
      offline fp8splits_offline.log "round $round ${PER_SM:-8} programs an SM" fp8 \
        --decode-programs-per-sm "${PER_SM:-8}"
    done ;;
  firstrun)
    # whole logs and each process's figures (--out: every run's host time by part, the
    # allocator's mallocs) kept, to tell start-up work left for the first run from the rest
    # (DTYPES narrows the processes; the report names the Triton kernel variants each run built)
    i=0
    for dtype in ${DTYPES:-auto auto fp8 fp8}; do
      i=$((i + 1))
      timeout 120 python3 -m benchmarks.offline --no-peer --kv-cache-dtype "$dtype" \
        --repeat 3 --out "$OUT/firstrun-$i-$dtype.json" 2>&1 | tee -a "$OUT/firstrun.log" \
        | grep -E "^nano-vLLM  |run [0-9]|host time" | sed "s/^/process $i $dtype: /"
    done ;;
  pdl)
    if [ -z "${SKIP_TESTS:-}" ]; then
      timeout "${TESTS_S:-420}" python3 -m pytest -q -m gpu -p no:cacheprovider -x \
        tests/engine/test_gpu_engine.py tests/engine/test_fp8_kv.py \
        tests/model/test_triton_linear.py tests/model/test_rope_store.py \
        tests/model/test_triton_attention.py -k "greedy or graph or fp8 or split or rope or longest" \
        2>&1 | tail -3 | tee "$OUT/pdl_tests.log"
    fi
    offline pdl_offline.log "warm-up, not counted" fp8
    for round in $(seq "${ROUNDS:-2}"); do
      for dtype in ${DTYPES:-fp8 auto}; do
        offline pdl_offline.log "round $round $dtype defaults (pdl)" "$dtype"
        offline pdl_offline.log "round $round $dtype no pdl" "$dtype" --no-pdl
      done
    done ;;
  fresh)
    for round in $(seq "${ROUNDS:-3}"); do
      for flags in "" --gc-freeze; do
        # shellcheck disable=SC2086
        TRITON_CACHE_DIR=$(mktemp -d) offline fresh.log "round $round ${flags:-defaults}" \
          "${DTYPE:-fp8}" $flags
      done
    done ;;
  layouts)
    if [ -z "${SKIP_TESTS:-}" ]; then
      timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/model/test_triton_fp8.py \
        tests/model/test_triton_fp8_decode.py tests/engine/test_fp8_kv.py \
        -k "plane or run_stores or equals_the_torch or transposed" 2>&1 | tail -3 \
        | tee "$OUT/layouts_tests.log"
    fi
    if [ -z "${SKIP_KERNELS:-}" ]; then
      for cold in "" --cold; do
        # shellcheck disable=SC2086
        timeout 120 python3 -m benchmarks.kv_store --tokens 256 2048 $cold 2>&1 \
          | tee -a "$OUT/layouts_store.log" | tail -12
      done
      for runs in --no-run-stores ""; do  # a prefill step's store, token by token / by runs
        # shellcheck disable=SC2086
        timeout 120 python3 -m benchmarks.kv_store --pattern prefill --tokens 2048 16384 \
          $runs 2>&1 | tee -a "$OUT/layouts_store.log" | tail -12
      done
      timeout 150 python3 -m benchmarks.attention --k-plane 2>&1 \
        | tee -a "$OUT/layouts_attention.log" | tail -16
    fi
    if [ -n "${PROFILE:-}" ]; then  # a 256-row fp8 decode step's kernels, each K layout
      for flags in "" --no-k-scale-plane; do
        # shellcheck disable=SC2086
        timeout 200 python3 -m benchmarks.profile_step --kv-cache-dtype fp8 $flags 2>&1 \
          | tee -a "$OUT/layouts_profile.log" | tail -30
      done
    fi
    offline layouts.log "warm-up, not counted" fp8
    for round in $(seq "${ROUNDS:-2}"); do
      offline layouts.log "round $round defaults" fp8
      offline layouts.log "round $round no k scale plane" fp8 --no-k-scale-plane
      offline layouts.log "round $round no run stores" fp8 --no-run-stores
      offline layouts.log "round $round neither" fp8 --no-k-scale-plane --no-run-stores
    done ;;
  klayout)
    flip() { sed -i "s/^FP8_K_HEAD_MAJOR = .*/FP8_K_HEAD_MAJOR = $1/" nanovllm/worker/kv_cache.py; }
    flip True
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_fp8_kv.py \
      tests/model/test_triton_fp8_decode.py tests/model/test_rope_store.py 2>&1 | tail -2 \
      | tee "$OUT/klayout_tests.log"
    for round in 1 2; do
      for layout in True False; do
        flip "$layout"
        # shellcheck disable=SC2086
        offline klayout.log "round $round head-major $layout" fp8 ${KLAYOUT_FLAGS:-}
      done
    done
    flip False ;;
  splitk)
    [ -n "${SKIP_TESTS:-}" ] || timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/model/test_triton_linear.py \
      2>&1 | tail -2 | tee "$OUT/splitk_tests.log"
    [ -n "${SKIP_TESTS:-}" ] || timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/engine/test_gpu_engine.py -k greedy 2>&1 | tail -2 | tee -a "$OUT/splitk_tests.log"
    for round in $(seq "${ROUNDS:-1}"); do  # ROUNDS=2 and SKIP_TESTS=1: a second call
      for dtype in fp8 auto; do
        for flags in "" "--no-split-k"; do
          # shellcheck disable=SC2086
          offline splitk.log "round $round $dtype ${flags:-split-k}" "$dtype" $flags --repeat 2
        done
      done
    done ;;
  tiles)
    for round in 1 2; do
      for pair in "fp8 ${FP8_TILE:-}" "auto ${BF16_TILE:-}"; do
        read -r dtype tile <<< "$pair"
        [ -n "$tile" ] || continue
        for flags in "" "--decode-tile $tile"; do
          # shellcheck disable=SC2086
          OFFLINE_S=110 offline tiles.log "round $round $dtype ${flags:-default}" "$dtype" $flags
        done
      done
    done ;;
  mallocs)
    timeout 150 python3 -m benchmarks.offline --no-peer --malloc-trace --kv-cache-dtype fp8 \
      --repeat 2 2>&1 | grep -E "^nano-vLLM" | tee "$OUT/mallocs.log" ;;
  gaps)
    for dtype in fp8 fp8 auto; do
      timeout 90 python3 -m benchmarks.offline --no-peer --gpu-gaps --kv-cache-dtype $dtype \
        2>&1 | grep -E "^nano-vLLM  |host time|^gaps" | sed "s/^/$dtype: /" | tee -a "$OUT/gaps.log"
    done ;;
  sampler)
    if [ -z "${SKIP_TESTS:-}" ]; then
      timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/model/test_triton_cdf_sampler.py tests/model/test_triton_sampler.py \
        tests/model/test_sampler.py 2>&1 | tail -3 | tee "$OUT/sampler_tests.log"
      timeout 120 python3 -m benchmarks.sampler --splits 4 8 16 32 2>&1 \
        | tee "$OUT/sampler_kernels.log"
    fi
    offline sampler.log "warm-up, not counted" fp8
    IFS='|' read -r -a variants <<< "${VARIANTS:-|--gumbel-sampler}"
    for round in $(seq "${ROUNDS:-2}"); do
      for flags in "${variants[@]}"; do
        # shellcheck disable=SC2086
        offline sampler.log "round $round ${flags:-defaults}" fp8 $flags
      done
    done ;;
  contexts)  # the fp8 decode over an engine step's contexts (benchmarks/decode_contexts.py,
    # its first run), then the fp8 prefill's tiles on main's kernel (2 stages measured 3%
    # faster over the V-scale-tile branch's)
    timeout 120 python3 -m benchmarks.decode_contexts 2>&1 | tee "$OUT/contexts.log"
    timeout 200 python3 -m benchmarks.attention --prefill --fp8 2>&1 \
      | tee "$OUT/prefill_tiles.log" | grep -E "^-- |default|m64 n64 w4" ;;
  vapart)  # each token's V stored by a program of its own in the fused RoPE + store
    if [ -z "${SKIP_TESTS:-}" ]; then
      timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/model/test_rope_store.py \
        tests/model/test_triton_fp8.py tests/engine/test_fp8_kv.py 2>&1 | tail -3 \
        | tee "$OUT/vapart_tests.log"
    fi
    store_ab vapart_store.log "" --v-with-k
    offline vapart.log "warm-up, not counted" fp8
    for round in $(seq "${ROUNDS:-3}"); do
      offline vapart.log "round $round defaults" fp8
      offline vapart.log "round $round --v-with-k" fp8 --v-with-k
    done ;;
  runheads)
    store_ab runheads_store.log "" --no-run-heads
    if [ "${ROUNDS:-0}" -gt 0 ]; then
      offline runheads.log "warm-up, not counted" fp8
      for round in $(seq "$ROUNDS"); do
        offline runheads.log "round $round defaults" fp8
        offline runheads.log "round $round --no-run-heads" fp8 --no-run-heads
      done
    fi
    if [ -z "${SKIP_TESTS:-}" ]; then
      timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/model/test_rope_store.py \
        tests/model/test_triton_fp8.py tests/engine/test_fp8_kv.py 2>&1 | tail -2 \
        | tee "$OUT/runheads_tests.log"
    fi ;;
  freshkv)  # kernels.FRESH_PREFILL (on); first the store with every launch's V apart
    # (--v-apart-all)
    [ -z "${SKIP_STORE:-}" ] && store_ab freshkv_store.log "" --v-apart-all
    if [ -z "${SKIP_TESTS:-}" ]; then
      timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/model/test_fresh_prefill.py tests/engine/test_fp8_kv.py 2>&1 | tail -2 \
        | tee "$OUT/freshkv_tests.log"
    fi
    if [ -z "${SKIP_TABLE:-}" ]; then
      timeout 150 python3 -m benchmarks.attention --fresh 2>&1 | tee "$OUT/freshkv_attention.log" \
        | grep -E "^(seed|prefill|chunk)" | tail -48
    fi
    if [ "${ROUNDS:-0}" -gt 0 ]; then
      for dtype in ${DTYPES:-fp8}; do
        offline freshkv.log "warm-up $dtype, not counted" "$dtype"
        for round in $(seq "$ROUNDS"); do
          offline freshkv.log "round $round $dtype defaults" "$dtype"
          offline freshkv.log "round $round $dtype --no-fresh-prefill" "$dtype" --no-fresh-prefill
        done
      done
    fi ;;
  rounds)  # the engine's defaults on this machine, fp8 and bf16 alternating (BENCHMARKS.md's
    # rounds tables), after any GPU tests named in TESTS
    if [ -n "${TESTS:-}" ]; then
      # shellcheck disable=SC2086
      timeout "${TESTS_S:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider $TESTS 2>&1 \
        | tail -3 | tee "$OUT/rounds_tests.log"
    fi
    offline rounds.log "warm-up fp8, not counted" fp8
    for round in $(seq "${ROUNDS:-5}"); do
      offline rounds.log "round $round fp8" fp8
      offline rounds.log "round $round bf16" auto
    done ;;
  smallgemm)  # triton_linear.SMALL_GEMMS (on)
    if [ -z "${SKIP_TESTS:-}" ]; then
      timeout "${TESTS_S:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider -x \
        tests/model/test_triton_linear.py tests/model/test_fused_ops.py 2>&1 | tail -2 \
        | tee "$OUT/smallgemm_tests.log"
    fi
    if [ -z "${SKIP_CHAIN:-}" ]; then
      # shellcheck disable=SC2086
      timeout 240 python3 -m benchmarks.blas --chain --rows ${CHAIN_ROWS:-1 16 32 64 128 256} \
        ${SWEEP:+--sweep} 2>&1 | tee "$OUT/smallgemm_chain.log" | tail -12
    fi
    if [ -z "${SKIP_PROFILE:-}" ]; then  # a 32-row decode step's kernels, each way
      for flags in "" "--no-small-gemms"; do
        # shellcheck disable=SC2086
        timeout 100 python3 -m benchmarks.profile_step --kv-cache-dtype fp8 --num-seqs 32 \
          $flags 2>&1 | grep -E "kernel|nvjet|Self CUDA" | sed "s/^/${flags:-defaults}: /" \
          | tee -a "$OUT/smallgemm_profile.log" | cut -c1-70,150-240
      done
    fi
    # the flag sets against the defaults, '|' between them
    IFS='|' read -r -a flag_sets <<< "${VARIANTS:---no-small-gemms}"
    for dtype in ${DTYPES:-fp8}; do
      offline smallgemm.log "warm-up $dtype, not counted" "$dtype"
      for round in $(seq "${ROUNDS:-2}"); do
        offline smallgemm.log "round $round $dtype defaults" "$dtype"
        for flags in "${flag_sets[@]}"; do
          # shellcheck disable=SC2086
          offline smallgemm.log "round $round $dtype $flags" "$dtype" $flags
        done
      done
    done ;;
  syncs)
    for dtype in auto fp8; do
      timeout 120 python3 -m benchmarks.offline --no-peer --sync-debug --kv-cache-dtype $dtype \
        2>&1 | grep -E "^nano-vLLM" | tee -a "$OUT/syncs.log"
    done ;;
  swap)
    timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/worker/test_host_pool.py \
      tests/engine/test_host_tier.py 2>&1 | tee "$OUT/swap_tests.log" | tail -3
    # 8 engines of the 8B shape, each loading 16 GB of weights and pinning ~20 GiB of swap
    timeout 520 python3 -m benchmarks.kv_tiers --shape 8b --only priority --repeat 2 \
      --out "$OUT/swap.json" 2>&1 | grep -v " INFO " | tee "$OUT/swap.log" | tail -16 ;;
  *)
    echo "unknown stage $stage: tests, kernels, profile, tp, serve, dp, store, mixedlat, fp8attn, fp8prefill, buffers, tiles, rounds, syncs or swap" >&2
    exit 2 ;;
esac
