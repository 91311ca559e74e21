#!/usr/bin/env bash
# Session 13, call 12: main at 2786512 (grouped query tiles): the package, the Python suite's
# GPU attention tests and bench attn.
REPO=$(cd "$(dirname "$0")/../.." && pwd)
cd $REPO && BARQTRAIN_GIT_COMMIT=2786512 CUDA_ARCHS=90a PHASES="build python bench-attn" PYTEST_ARGS="-m gpu -k attention" \
  timeout 560 bash scripts/gpu_check.sh $OUT/check > $OUT/check.out 2>&1
tail -5 $OUT/check.out; grep -E "passed|failed" $OUT/check/gpu_check.log | tail -1
