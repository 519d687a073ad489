#!/usr/bin/env bash
# The GPU checks in one call on a machine with an NVIDIA GPU and no network: what its image
# lacks comes as wheels in .whl/ and Debian packages in .deb/ (`make gpu-carry` fetches
# both here, for Python 3.12). Then: the CUDA tests, benchmarks/gpu.py (the engine and the
# KV path on the card), tests/e2e/test_pipeline.py on the GPU, and benchmarks/prefill.py (a)
# and (c) on live clusters of 8B-shaped workers. Logs go to $OUT (or /tmp/gpu-out); each
# step has its own deadline.
#
#   bash benchmarks/gpu_device.sh [quick | prefill | pieces | check | engine | kv
#                                  | live | open | pipeline [-k expr] | warm | goals | replay]
#       (quick: no prefill benchmark; prefill: only it; pieces: only gpu.py's scattered
#       pieces; check: the tests and the prefill benchmark, not gpu.py; live: the tests;
#       open [-k expr]: the prefill benchmark, then the live tests; pipeline [-k expr]:
#       the live tests alone; engine: issue 25's call: gpu.py's engine figures saved as
#       $OUT/gpu.json (SWEEP=1: the attention kernel at other launch shapes too), the
#       CUDA tests, and the live tests, whose decode worker replays
#       CUDA graphs; kv: issue 26's call: the CUDA IPC and pinned-memory tests,
#       benchmarks/kv_gpu.py, live clusters over each KV path, the prefill benchmark, and
#       the goals merged into $OUT/gpu-kv.json; warm: issue 26 goal 3: the chunk
#       attention tests and benchmark, the prefill benchmark, kv_gpu.py, the goals merged,
#       a profiled pass (PROFILE_LENGTHS, default 1024,4096: the last one warm; step
#       profiles in $OUT/profiles.tgz), the live KV-path tests; goals: the same without
#       the profiles, the goals first; replay: issue 26 goal 5: benchmarks/gpu_replay.py, a
#       trace replayed on one GPU's cluster over the same-host paths and over TCP, its
#       JSON as $OUT/gpu-replay.json (REPLAY_ARGS="--graph-tokens 512": with prompt
#       graphs, preempting steps nested in their graphed steps included); graphs: prompt steps as piecewise CUDA graphs, the
#       GPU test and benchmarks/prompt_graphs.py (graphed vs eager steps of one engine);
#       graphs-live: then the prefill benchmark with prefill_graph_tokens = 512; next:
#       graphs, the chunk attention benchmark and replay in one call, ~7 minutes;
#       timeline: the prefill benchmark alone at 4k and 16k, once each, with part (d):
#       where the warm prompt's time outside its compute goes, ~3 minutes; moe: mixtures
#       of experts and latent attention, never yet on a GPU: their CUDA test, then
#       gpu.py's decode of Qwen3-30B-A3B's and Moonlight-16B-A3B's shapes, 12 layers each,
#       as $OUT/gpu-moe-*.json, ~4 minutes (an estimate))
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
log() { echo "== $(date +%T) $*"; }

log "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"

log "install the carried wheels"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1

# The transfer engine's native libraries: the CUDA runtime from the image's pip packages,
# and from the carried .debs only the libraries the image lacks (never shadow its own).
mkdir -p /tmp/deb /tmp/xlib
for f in .deb/*.deb; do dpkg -x "$f" /tmp/deb; done
cudart=$(python3 -c "import glob, sys; print(next((p for d in sys.path if d for p in glob.glob(d + '/nvidia/**/libcudart.so.13', recursive=True)), ''))")
export LD_LIBRARY_PATH=/tmp/xlib:${cudart%/*}:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for _ in 1 2 3; do
  for lib in $(ldd /tmp/site/mooncake/engine.so /tmp/deb/usr/lib/x86_64-linux-gnu/*.so* 2>/dev/null \
               | awk '/not found/ {print $1}' | sort -u); do
    found=$(find /tmp/deb -name "$lib" | head -1)
    [ -n "$found" ] && cp -L "$found" /tmp/xlib/ && echo "carried $lib"
  done
done
ldd /tmp/site/mooncake/engine.so | grep "not found" && log "transfer engine: libraries missing"
python3 -c "from mooncake.engine import TransferEngine; print('transfer engine imports')"

cuda_tests() {
  log "CUDA tests"
  timeout 150 python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests/model/test_cuda.py \
    tests/model/test_cuda_graphs.py tests/model/test_flash_attention.py tests/engine/test_prompt_graphs.py 2>&1 \
    | tee "$OUT/pytest.log" | grep -v "^[IWE][0-9]" | tail -25
}

live_pipeline() {  # [pytest -k expression]
  log "live clusters on the GPU: greedy outputs with 1-3 pipeline stages, layer-wise or not"
  CRESCENT_TEST_DEVICE=cuda CRESCENT_TEST_MODEL=dummy-bench-prefill timeout 200 \
    python3 -m pytest -q -rs -p no:cacheprovider --basetemp=/tmp/pipeline tests/e2e/test_pipeline.py \
    ${1:+-k "$1"} 2>&1 | tee "$OUT/pipeline.log" | grep -v "^[IWE][0-9]" | tail -8
  tar czf "$OUT/pipeline-logs.tgz" -C /tmp pipeline 2>/dev/null
}

engine_figures() {
  log "engine and KV path (benchmarks/gpu.py)"
  timeout 240 python3 benchmarks/gpu.py 2>&1 | tee "$OUT/gpu.log" | grep -v "^[IWE][0-9]" | tail -30
}

engine_only() {  # issue 25: decode graphs and kernels, prefill, the floor; JSON kept
  log "engine figures (benchmarks/gpu.py --no-kv)"
  timeout 220 python3 benchmarks/gpu.py --no-kv ${SWEEP:+--sweep} --out "$OUT/gpu.json" 2>&1 \
    | tee "$OUT/gpu.log" \
    | grep -v "^[IWE][0-9]" | tail -30
}

graphs_in_logs() {  # the live decode worker captured and so replays graphs
  tar xzf "$OUT/pipeline-logs.tgz" -C /tmp 2>/dev/null
  grep -rh "decode CUDA graphs captured" /tmp/pipeline 2>/dev/null | head -3 \
    || echo "no decode worker log says it captured CUDA graphs"
}

pieces() {  # only the transfer engine's cost per scattered piece
  timeout 200 python3 benchmarks/gpu.py --pieces-only 2>&1 | tee "$OUT/pieces.log" | grep -v "^[IWE][0-9]"
}

prefill_bench() {  # [more prefill.py arguments]; (d): each request's stages timed
  log "prefill benchmark on the GPU (benchmarks/prefill.py --timeline $*)"
  timeout 250 python3 benchmarks/prefill.py --device cuda --model dummy-llama3-8b --dtype bfloat16 \
    --reps 2 --segment-mb 14336 --out /tmp/prefill-gpu --timeline "$@" > "$OUT/prefill.log" \
    2> "$OUT/prefill.err"
  echo "rc=$?"
  grep -v "^{" "$OUT/prefill.log" | tail -52  # the JSON line stays in the file
  grep -v "^[IWE][0-9]" "$OUT/prefill.err" | tail -8
  tar czf "$OUT/prefill-logs.tgz" -C /tmp prefill-gpu 2>/dev/null
}

reap() {  # a step cut off by its timeout leaves no cluster holding the GPU
  pkill -f "services\.(decode|prefill|store_node|router|conductor|store_master)" 2>/dev/null
  sleep 1
  rm -rf /dev/shm/crescent*
}

kv_issue() {  # issue 26: GPU KV on one host; the figures saved as $OUT/gpu-kv.json (a call
  # brings back 8 files from $OUT: keep it to these)
  log "CUDA IPC, pinned-memory and launched-read tests"
  timeout 90 python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests/kv/test_cuda_kv_paths.py \
    2>&1 | grep -v "^[IWE][0-9]" | tail -12
  prefill_bench
  reap
  log "live clusters: greedy outputs over TCP, CUDA IPC and pinned memory"
  CRESCENT_TEST_DEVICE=cuda CRESCENT_TEST_MODEL=dummy-bench-prefill timeout 150 \
    python3 -m pytest -q -rs -p no:cacheprovider --basetemp=/tmp/kvpaths \
    tests/e2e/test_gpu_kv_paths.py 2>&1 | grep -v "^[IWE][0-9]" | tail -12
  tar czf "$OUT/kv-e2e-logs.tgz" -C /tmp kvpaths 2>/dev/null
  reap
  log "KV paths side by side (benchmarks/kv_gpu.py)"
  timeout 75 python3 benchmarks/kv_gpu.py --reps 3 --out "$OUT/kv.json" 2>&1 \
    | grep -v "^[IWE][0-9]" | grep -v "^{" | tail -20
  python3 benchmarks/kv_gpu.py --merge "$OUT/kv.json" --prefill "$OUT/prefill.log" \
    --out "$OUT/gpu-kv.json" | grep -v "^{"
}

profiled_pass() {  # LENGTHS; CRESCENT_PROFILE_DIR: where a warm prompt's step spends its time
  log "profiled prefill steps at $1 (common/engine/profiling.py; the last length also warm)"
  mkdir -p /tmp/prof
  CRESCENT_PROFILE_DIR=/tmp/prof CRESCENT_PROFILE_STEPS=3 timeout 200 python3 \
    benchmarks/prefill.py --device cuda --model dummy-llama3-8b --dtype bfloat16 --reps 1 \
    --lengths "$1" --segment-mb 8192 --out /tmp/prefill-prof > /tmp/prof/prefill-prof.log 2>&1
  echo "rc=$?"
  head -qn1 /tmp/prof/*.txt 2>/dev/null
  grep "^ *[0-9]* *\(layerwise\|after\) " /tmp/prof/prefill-prof.log | tail -4
  tar czf "$OUT/profiles.tgz" -C /tmp prof 2>/dev/null
}

chunk_checks() {  # common/model/chunk_attention.py's split of a chunk after a prefix
  log "chunk attention after a prefix: GPU tests, then masked vs split (benchmarks/chunk_attention.py)"
  { timeout 150 python3 -m pytest -q -rs -p no:cacheprovider -m gpu -s \
      tests/model/test_chunk_attention.py tests/model/test_cuda.py 2>&1 | grep -v "^[IWE][0-9]" | tail -15
    timeout 60 python3 benchmarks/chunk_attention.py 2>&1 | grep -v "^{"; } | tee "$OUT/checks.log"
}

kv_goals() {  # kv_gpu.py, then issue 26's goals merged with the prefill benchmark's
  log "KV paths side by side (benchmarks/kv_gpu.py)"
  timeout 75 python3 benchmarks/kv_gpu.py --reps 3 --out "$OUT/kv.json" 2>&1 \
    | grep -v "^[IWE][0-9]" | grep -v "^{" | tail -20
  python3 benchmarks/kv_gpu.py --merge "$OUT/kv.json" --prefill "$OUT/prefill.log" \
    --out "$OUT/gpu-kv.json" | grep -v "^{" | tail -2
}

kv_e2e() {
  log "live clusters: greedy outputs over TCP, CUDA IPC and pinned memory"
  CRESCENT_TEST_DEVICE=cuda CRESCENT_TEST_MODEL=dummy-bench-prefill timeout 150 \
    python3 -m pytest -q -rs -p no:cacheprovider --basetemp=/tmp/kvpaths \
    tests/e2e/test_gpu_kv_paths.py 2>&1 | grep -v "^[IWE][0-9]" | tail -12
  tar czf "$OUT/kv-e2e-logs.tgz" -C /tmp kvpaths 2>/dev/null
}

warm_issue() {  # issue 26 goal 3: checks, the goals, then profiles (8 files back)
  chunk_checks
  prefill_bench
  reap
  kv_goals
  profiled_pass "${PROFILE_LENGTHS:-1024,4096}"
  reap
  kv_e2e
}

replay() {  # issue 26 goal 5: zero errors and no leaked block over each KV path
  log "a trace replay on one GPU over each KV path (benchmarks/gpu_replay.py)"
  timeout 480 python3 benchmarks/gpu_replay.py --device cuda --out /tmp/gpu-replay ${REPLAY_ARGS:-} \
    > "$OUT/replay.log" 2> "$OUT/replay.err"
  echo "rc=$?"
  grep -v "^{" "$OUT/replay.log" | tail -12
  grep -v "^[IWE][0-9]" "$OUT/replay.err" | tail -6
  cp /tmp/gpu-replay/gpu-replay.json "$OUT/" 2>/dev/null
  tar czf "$OUT/replay-logs.tgz" -C /tmp gpu-replay 2>/dev/null
}

prompt_graphs() {  # piecewise CUDA graphs of prompt steps (common/engine/prompt_graphs.py);
  # GRAPHS_OK=1 where the GPU test passed
  log "prompt graphs: the GPU test, then graphed vs eager steps (benchmarks/prompt_graphs.py)"
  timeout 150 python3 -m pytest -q -rs -p no:cacheprovider -m gpu \
    tests/engine/test_prompt_graphs.py > "$OUT/prompt-graphs-test.log" 2>&1 && GRAPHS_OK=1
  grep -v "^[IWE][0-9]" "$OUT/prompt-graphs-test.log" | tail -8
  timeout 240 python3 benchmarks/prompt_graphs.py --device cuda > "$OUT/prompt-graphs.log" 2>&1
  echo "rc=$?"
  grep -v "^[IWE][0-9]" "$OUT/prompt-graphs.log" | tail -12
}

case "${1:-all}" in
  quick) cuda_tests; live_pipeline; engine_figures ;;
  prefill) prefill_bench ;;
  pieces) pieces ;;
  check) cuda_tests; prefill_bench; live_pipeline ;;
  engine) engine_only; cuda_tests; live_pipeline "${2:-}"; graphs_in_logs ;;
  live) cuda_tests; live_pipeline "${2:-}" ;;  # [pytest -k expression]
  open) prefill_bench; live_pipeline "${2:-}" ;;  # [pytest -k expression]
  kv) kv_issue ;;
  warm) warm_issue ;;
  goals) prefill_bench; reap; kv_goals; chunk_checks; kv_e2e ;;  # warm without profiles
  pipeline) live_pipeline "${2:-}" ;;  # [pytest -k expression]
  replay) replay ;;
  graphs) prompt_graphs ;;
  next)  # what the 2026-11-28 night session prepared, in one call (~7 minutes): the prompt
    # graphs, the chunk attention's one-call column, then goal 5's replay (40 requests),
    # with the graphs on where their GPU test passed
    prompt_graphs
    log "chunk attention after a prefix (benchmarks/chunk_attention.py)"
    timeout 60 python3 benchmarks/chunk_attention.py 2>&1 | grep -v "^[IWE][0-9]" \
      | tee "$OUT/chunk-attention.log" | grep -v "^{"
    reap
    REPLAY_ARGS="--requests 40 ${GRAPHS_OK:+--graph-tokens 512}" replay ;;
  graphs-live) prompt_graphs; reap; prefill_bench --graph-tokens 512 --lengths 1024,4096,16384 ;;
  timeline)  # goal 3's 27 ms outside the warm 16k compute, hop by hop (part d): ~3 minutes
    # (an estimate), a call that fits after `next` on one lend
    prefill_bench --lengths 4096,16384 --reps 1 ;;
  moe)
    log "mixtures and latent attention: the CUDA test"
    timeout 150 python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests/model/test_cuda.py \
      -k mixtures 2>&1 | grep -v "^[IWE][0-9]" | tail -15
    for model in dummy-qwen3-30b-a3b dummy-moonlight-16b-a3b; do
      log "decode of $model, 12 layers (benchmarks/gpu.py --decode-only --no-kv)"
      timeout 150 python3 benchmarks/gpu.py --model "$model" --layers 12 --decode-only \
        --no-kv --out "$OUT/gpu-moe-$model.json" 2>&1 | grep -v "^[IWE][0-9]" | tail -12
    done ;;
  *) cuda_tests; live_pipeline; engine_figures; prefill_bench ;;
esac
log "done"
