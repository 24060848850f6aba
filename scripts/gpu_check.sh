#!/usr/bin/env bash
# The engine's checks on one CUDA card, in the order a short GPU session should run them:
#
#   bash scripts/gpu_check.sh OUT_DIR [STEP ...]     (default steps: all of them, in this order)
#
#   env          the card, driver, torch, Triton, transformers and commit -> OUT_DIR/env.txt
#   warm-test    the worker warm-up's GPU test (tests/worker/test_gpu_engine.py -k warm_up)
#   cost         the cost workload at the card's limits, three alternating passes, after the
#                shipped warm-up (Engine.warm_up) -> OUT_DIR/cost/engine-gpu.json
#   cost-control the same in a second process without the warm-up's eager lm_head
#                (--no-warm-logits): its first pass is where a cold worker's first requests
#                pay for new row counts -> OUT_DIR/cost-no-warm-logits/
#   det          kernel self-check, decode step per batch size, the determinism experiment and
#                score == sampled logprob -> OUT_DIR/det/
#   gpu-tests    the GPU-marked tests, then the kernel test files that run natively on CUDA
#                -> OUT_DIR/gpu-tests.log, OUT_DIR/kernel-files.log
#   profile      where each step shape's GPU time goes, by kind of kernel, with its eager head
#                (detgate.bench.step_profile) -> OUT_DIR/profile/step-profile.json
#
# Each step runs in a process of its own under `timeout` (STEP_TIMEOUT, seconds, default 300;
# the engine experiment also stops starting phases after DEADLINE, default 150), so one that
# hangs leaves the later ones their time. Run from the repository root with detgate importable
# (its .venv, or PYTHONPATH=. where the device image carries torch). The exit status is the
# number of steps that failed. Results go into bench/results/ as *-<card>-<date>-<commit>*.
set -uo pipefail

if [ $# -lt 1 ]; then
  sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
OUT=$1
shift
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(env warm-test cost cost-control det gpu-tests profile)
PY=${PYTHON:-python}
STEP_TIMEOUT=${STEP_TIMEOUT:-300}
DEADLINE=${DEADLINE:-150}
COMMIT=${DETGATE_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
export DETGATE_GIT_COMMIT=$COMMIT
mkdir -p "$OUT"

engine() {  # engine NAME ARGS...: python -m detgate.bench.engine_gpu into OUT/NAME
  local name=$1
  shift
  timeout "$STEP_TIMEOUT" "$PY" -m detgate.bench.engine_gpu --deadline "$DEADLINE" \
    --out "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
}

pytest_log() {  # pytest_log LOG ARGS...
  local log=$1
  shift
  timeout "$STEP_TIMEOUT" "$PY" -m pytest -q -p no:cacheprovider "$@" > "$OUT/$log" 2>&1
}

step() {
  case $1 in
    env)
      { nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit,driver_version \
          --format=csv,noheader
        echo "commit $COMMIT"
        "$PY" -c 'import torch, triton, transformers
print("torch", torch.__version__, "triton", triton.__version__,
      "transformers", transformers.__version__)'; } > "$OUT/env.txt" 2>&1 ;;
    warm-test) pytest_log warm-test.log -m gpu tests/worker/test_gpu_engine.py -k warm_up ;;
    cost) engine cost --repeats 3 --phases build,warmup,cost_async ;;
    cost-control) engine cost-no-warm-logits --repeats 3 --phases build,warmup,cost_async \
                    --no-warm-logits ;;
    det) engine det --phases kernel_check,build,warmup,decode_step,determinism,score ;;
    gpu-tests)
      # tests/deploy holds no GPU test, and its modules import the deploy checks' own
      # dependencies (jsonschema, kubernetes-validate), which a GPU image need not carry.
      pytest_log gpu-tests.log -m gpu tests --ignore=tests/deploy
      local rc=$?
      pytest_log kernel-files.log tests/kernels/test_attention_triton.py \
        tests/kernels/test_mode.py tests/kernels/test_triton_ops.py \
        tests/kernels/test_fused_triton.py || rc=$?
      return $rc ;;
    profile) timeout "$STEP_TIMEOUT" "$PY" -m detgate.bench.step_profile --out "$OUT/profile" \
               > "$OUT/profile.log" 2>&1 ;;
    *) echo "unknown step $1" >&2; return 2 ;;
  esac
}

failed=0
for s in "${STEPS[@]}"; do
  start=$SECONDS
  step "$s"
  rc=$?
  [ $rc -ne 0 ] && failed=$((failed + 1))
  echo "$s: rc=$rc in $((SECONDS - start)) s" | tee -a "$OUT/steps.txt"
done
exit $failed
