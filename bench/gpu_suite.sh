#!/usr/bin/env bash
# Everything that needs a CUDA GPU, in one go: the `gpu`-marked tests, then the
# benchmarks, logs and JSON under $OUT (default ./gpu-results).
#
#   source .gpu-kit/setup.sh && bash bench/gpu_suite.sh [pytest -k expression]
# (the other tests need no GPU; tests/ppo/engines falls back to the engines alone where the host lacks the driver's packages.)
#
# Each step runs even when an earlier one failed; the exit status is the worst one.
set -uo pipefail
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__)' | tee -a "$OUT/gpu.txt"
status=0
step() {  # name, command...
  local name=$1; shift
  echo "=== $name: $*"
  "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc"
  [ "$rc" -gt "$status" ] && status=$rc
  return 0
}
step tests python3 -m pytest tests/lifecycle tests/value_transfer tests/megatron tests/ppo/engines tests/ppo/reward_model/test_gpu.py -m gpu -p no:cacheprovider -q -rA ${1:+-k "$1"}
[ -n "${SKIP_BENCH:-}" ] && exit $status
step lifecycle python3 bench/lifecycle_bench.py --gib 8 --out "$OUT/lifecycle.json"
step value_transfer python3 bench/value_transfer_bench.py --device cuda --out "$OUT/value_transfer.json"
step worker python3 bench/worker_gpu_bench.py --out "$OUT/worker.json"
step swiglu python3 bench/swiglu_kernel_bench.py --out "$OUT/swiglu_kernel_bench.json"
# The SwiGLU kernels by the size of the call: the default (kernels from swiglu.MIN_ELEMENTS on), every call
# (--fused-swiglu) and none (--no-fused-swiglu), on the packed path with rows of new lengths each call and
# at micro batch 32 (docs/benchmarks.md, "the SwiGLU kernels by the size of the call").
for swiglu in default fused-swiglu no-fused-swiglu; do
  flag=(); [ "$swiglu" = default ] || flag=(--"$swiglu")
  step "train_packed_$swiglu" python3 bench/train_profile.py --shape qwen2.5-0.5b --seq-len 640 --prompt-len 128 \
    --samples 256 --micro-batch-size 16 --iters 3 --no-profile --role actor --packed --varied-lengths \
    "${flag[@]}" --out "$OUT/train_packed_$swiglu.json"
  step "train_mb32_$swiglu" python3 bench/train_profile.py --shape qwen2.5-0.5b --seq-len 640 --prompt-len 128 \
    --samples 256 --micro-batch-size 32 --iters 3 --no-profile --role actor "${flag[@]}" \
    --out "$OUT/train_mb32_$swiglu.json"
done
step engine python3 bench/engine_bench.py --out "$OUT/engine.json"
step ppo python3 bench/ppo_gpu_bench.py --out "$OUT"
# Every path users take (fixed shapes, packed realistic lengths, micro-batches by tokens), shared and
# resident, against bench/regression_baseline.json: fails where a step got slower than the tolerance.
step regression python3 bench/regression_check.py --out "$OUT/regression"
step ppo_reward_model python3 bench/ppo_gpu_bench.py --reward-model --skip-probe --out "$OUT/reward_model"
exit $status
