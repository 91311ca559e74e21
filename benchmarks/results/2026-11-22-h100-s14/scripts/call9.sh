#!/usr/bin/env bash
# Session 14, call 9: main at 095b6c6, the package and the whole Python suite's GPU tests
# (bitsandbytes and nvidia-cutlass wheels carried in .whl/).
REPO=$(cd "$(dirname "$0")/../.." && pwd)
cd $REPO && BARQTRAIN_GIT_COMMIT=095b6c6 CUDA_ARCHS=90a PHASES="build python" PYTEST_ARGS="-m gpu" \
  timeout 580 bash scripts/gpu_check.sh $OUT/check > $OUT/check.out 2>&1
tail -5 $OUT/check.out; grep -E "passed|failed|error" $OUT/check/gpu_check.log | tail -3
