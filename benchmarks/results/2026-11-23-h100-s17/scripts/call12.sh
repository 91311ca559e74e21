#!/usr/bin/env bash
# Session 17, call 12: main after the first-step split: the package built on the device, the
# Python GPU attention tests and `bench attn`.
cd "$(dirname "$0")/../.." && BARQTRAIN_GIT_COMMIT=$(cat .scratch/s17/commit) CUDA_ARCHS=90a PHASES="build python bench-attn" \
  PYTEST_ARGS="-m gpu -k attention" timeout 580 bash scripts/gpu_check.sh $OUT/check > $OUT/check.out 2>&1
tail -6 $OUT/check.out
