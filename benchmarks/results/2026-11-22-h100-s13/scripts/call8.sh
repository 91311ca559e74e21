#!/usr/bin/env bash
# Session 13, call 8: main at 6d82aa8: the package and every GPU test of the Python suite.
REPO=$(cd "$(dirname "$0")/../.." && pwd)
cd $REPO && BARQTRAIN_GIT_COMMIT=6d82aa8 CUDA_ARCHS=90a PHASES="build python" PYTEST_ARGS="-m gpu" timeout 580 bash scripts/gpu_check.sh $OUT/check > $OUT/check.out 2>&1
tail -4 $OUT/check.out; grep -E "passed|failed" $OUT/check/gpu_check.log | tail -2
