#!/usr/bin/env bash
# One GPU check for a lent GPU machine: one H200 (16 cores, no network, Python 3.12 at
# python3 with torch, transformers and the rest of bench/gpu_check.py's PREINSTALLED), the
# working tree run with PYTHONPATH=. (not installed), < 10 min in all.
#
#   bench/gpu_check.sh [--dry-run] [--out FILE] [--only STEP,STEP]
#
# Steps (each named; its log's tail printed; a failing step makes the script exit 1 naming it):
#   wheels            install bench/gpu_requirements.txt offline from bench/gpu_wheels/ (`make
#                     gpu-wheels` fetches them where a registry is reachable) into a temp folder
#   env               torch, CUDA and the GPU (fails without CUDA)
#   main_job          graphs/arith_grpo.py with its own settings on CUDA; held-out accuracy gain
#   engine_throughput embedded engine vs HF generate (fp32, bf16), SmolLM2-135M's shape built in code
#   train_throughput  trainer tokens/s, padded vs packed (tiny-arith and SmolLM2-135M's shape)
#   weight_sync       weight-channel update time (270 MB, SmolLM2-135M in bf16)
#   longtail          bench/async_vs_sync.py --task longtail (one GPU: colocated, they alternate)
#   vllm_engine       optional: skipped (not failed) when vllm is not importable
# A step that exits 77 is skipped, which is not a failure; a missing wheel is a failure.
# Results: one JSON (--out, default $OUT/gpu_check.json, else ./gpu_check.json) with every
# step's rc, seconds and status, the main job's accuracy gain, each bench's headline figures
# and its log's tail; the step logs go next to it (gpu_check_logs/). bench/gpu_wheels/ is
# git-ignored: a lent machine gets it only when the run names it in `carry` (with the tree:
# ~8 MiB of the 64 allowed).
#
# --dry-run (CPU, ~3 min): runs every step here at a tiny size on CPU (the main job for 2
# steps, each bench with its smallest arguments) with every installed package the GPU
# machine will not have hidden (bench/gpu_offline/sitecustomize.py), so a broken step or an
# import not covered by the preinstalled packages plus the wheels fails it; checks the wheel
# folder when it exists. Writes no results. Environment: PYTHON (default python3),
# GPU_WHEELS (bench/gpu_wheels), GPU_PRESET (cluster.gpu: H200), and each step's arguments: MAIN_KEYS,
# ENGINE_ARGS, TRAIN_ARGS, SYNC_ARGS, LONGTAIL_KEYS, STEP_LIMIT_S (seconds per step).
set -uo pipefail

DRY=0
ONLY=""
RESULT="${OUT:-.}/gpu_check.json"
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --out) RESULT="$2"; shift ;;
    --only) ONLY=",$2,"; shift ;;
    *) echo "gpu_check.sh: unknown argument $1 (use --dry-run, --out FILE, --only STEP,STEP)" >&2; exit 2 ;;
  esac
  shift
done
case "$RESULT" in /*) ;; *) RESULT="$PWD/$RESULT" ;; esac  # relative to where it was called
cd "$(dirname "$0")/.."

PY="${PYTHON:-python3}"
WHEELS="${GPU_WHEELS:-bench/gpu_wheels}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
export AREAL_FLOW_CACHE="${AREAL_FLOW_CACHE:-$WORK/cache}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1  # no network there; nothing here may need one
export PYTHONPATH="$WORK/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
AF="$PY -m areal_flow.cli"
PIP_INSTALL="$PY -m pip install -q --no-index --no-deps --find-links $WHEELS -r bench/gpu_requirements.txt"

if [ "$DRY" = 1 ]; then
  # What the GPU machine lacks is hidden in every step and every process a step starts.
  GPU_CHECK_HIDE="$($PY bench/gpu_check.py hide)" || { echo "gpu_check.sh: bench/gpu_check.py hide failed" >&2; exit 1; }
  export GPU_CHECK_HIDE PYTHONPATH="$PWD/bench/gpu_offline:$PYTHONPATH"
  N_GPU=0
  DEVICE=cpu
  CLUSTER="cluster.gpu=cpu cluster.n_gpus_per_node=1"
  : "${MAIN_KEYS:=train.steps=2 train.batch_size=2 warm_start.steps=5 warm_start.batch_size=8 eval.n_test=8}"
  : "${ENGINE_ARGS:=--model tiny-arith --batch 2 --max-new-tokens 2 --repeats 1 --threads 1}"
  : "${TRAIN_ARGS:=--models tiny-s --rows-tiny 4 --max-response 16 --rounds 1}"
  : "${SYNC_ARGS:=--mb 1 --versions 2}"
  : "${LONGTAIL_KEYS:=train.steps=2 train.batch_size=2 gen.max_new_tokens=16 warm_start.steps=5 warm_start.batch_size=8}"
  : "${STEP_LIMIT_S:=300}"  # the long-tail step runs 4 jobs: ~2 min on 2 busy cores
  # the wheels are cp312: pip checks here that they install for the GPU machine's Python
  WHEEL_STEP="if [ ! -d $WHEELS ]; then echo 'no $WHEELS folder (make gpu-wheels): not checked'; exit 77; fi
    $PY bench/gpu_check.py wheels $WHEELS && $PIP_INSTALL --target $WORK/site312 --only-binary=:all: \
    --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64"
else
  N_GPU=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU')
  [ "$N_GPU" -ge 1 ] || { echo "gpu_check.sh: no GPU (nvidia-smi -L lists none); try --dry-run" >&2; exit 2; }
  DEVICE=cuda
  # one GPU: generation and training share it (colocated); two or more: one each
  CLUSTER="cluster.gpu=${GPU_PRESET:-H200} cluster.n_gpus_per_node=$(( N_GPU >= 2 ? 2 : 1 ))"
  : "${MAIN_KEYS:=}"  # graphs/arith_grpo.yaml as it is: the main job's settings
  : "${ENGINE_ARGS:=--model SmolLM2-135M --device cuda --batch 64 --max-new-tokens 128 --repeats 2 --threads 4}"
  : "${TRAIN_ARGS:=--models tiny-arith,SmolLM2-135M --device cuda --rows-tiny 128 --rows-smollm2 32 --rounds 3 --threads 4}"
  : "${SYNC_ARGS:=--mb 270 --versions 5}"
  : "${LONGTAIL_KEYS:=}"
  : "${STEP_LIMIT_S:=}"
  # pip when the interpreter has it, else the wheels unzipped (all that these need)
  WHEEL_STEP="$PY bench/gpu_check.py wheels $WHEELS || exit 1
    if $PY -m pip --version > /dev/null 2>&1; then $PIP_INSTALL --target $WORK/site
    else $PY bench/gpu_check.py unpack $WHEELS $WORK/site; fi"
fi

declare -a NAMES CMDS LIMITS
add() { NAMES+=("$1"); LIMITS+=("${STEP_LIMIT_S:-$2}"); CMDS+=("$3"); }
# GPU limits (seconds) add up to 580: the lent machine runs one command for at most 10 min
add wheels 20 "$WHEEL_STEP"
add env 25 "$PY bench/gpu_check.py env $DEVICE $WORK/env.json"
add main_job 225 "$AF run graphs/arith_grpo.py $CLUSTER $MAIN_KEYS out_dir=$WORK/runs name=main \
  && $PY bench/gpu_check.py gain $WORK/runs/main/summary.json"
add engine_throughput 75 "$PY bench/engine_throughput.py $ENGINE_ARGS"
add train_throughput 55 "$PY bench/train_throughput.py $TRAIN_ARGS"
add weight_sync 25 "$PY bench/weight_sync.py $SYNC_ARGS"
add longtail 145 "$PY bench/async_vs_sync.py --task longtail $CLUSTER $LONGTAIL_KEYS out_dir=$WORK/runs_longtail"
add vllm_engine 10 "$PY -c 'import vllm' 2>/dev/null || { echo 'vllm not importable: skipped'; exit 77; }
  $PY -m pytest -q -m vllm tests/test_vllm_engine.py"

for step in ${ONLY//,/ }; do
  [[ " ${NAMES[*]} " == *" $step "* ]] || { echo "gpu_check.sh: unknown step $step (steps: ${NAMES[*]})" >&2; exit 2; }
done
echo "gpu_check.sh: $([ "$DRY" = 1 ] && echo "dry run on CPU" || echo "$N_GPU GPU(s)"), python $PY, work folder $WORK"
FAILED=()
: > "$WORK/steps.jsonl"
for i in "${!NAMES[@]}"; do
  name="${NAMES[$i]}"
  if [ -n "$ONLY" ] && [[ "$ONLY" != *",$name,"* ]]; then continue; fi
  echo "=== $name (limit ${LIMITS[$i]} s): ${CMDS[$i]}"
  start=$(date +%s)
  timeout -k 10 "${LIMITS[$i]}" bash -c "${CMDS[$i]}" > "$WORK/$name.log" 2>&1
  rc=$?
  seconds=$(( $(date +%s) - start ))
  tail -n 12 "$WORK/$name.log" | sed 's/^/    /'
  case "$rc" in
    0) status=ok ;;
    77) status=skipped ;;
    124|137) status=failed; echo "    (timed out after ${LIMITS[$i]} s)" ;;
    *) status=failed ;;
  esac
  [ "$status" = failed ] && FAILED+=("$name")
  echo "--- $name: $status (rc $rc, ${seconds} s)"
  printf '{"name": "%s", "status": "%s", "rc": %d, "seconds": %d, "limit_s": %d}\n' \
    "$name" "$status" "$rc" "$seconds" "${LIMITS[$i]}" >> "$WORK/steps.jsonl"
done

if [ "$DRY" = 0 ]; then
  mkdir -p "$(dirname "$RESULT")/gpu_check_logs"
  cp "$WORK"/*.log "$(dirname "$RESULT")/gpu_check_logs/" 2>/dev/null
  $PY bench/gpu_check.py result "$WORK" "$RESULT" || FAILED+=(result)
else  # the JSON is assembled (and checked) but not kept
  $PY bench/gpu_check.py result "$WORK" "$WORK/gpu_check.json" > /dev/null || FAILED+=(result)
fi
if [ "${#FAILED[@]}" -gt 0 ]; then
  echo "gpu_check.sh: FAILED step(s): ${FAILED[*]}" >&2
  exit 1
fi
echo "gpu_check.sh: $([ "$DRY" = 1 ] && echo "dry run: ok" || echo "ok")"
