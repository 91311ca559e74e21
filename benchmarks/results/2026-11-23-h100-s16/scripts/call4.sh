#!/usr/bin/env bash
# Session 16, call 4 (572c3d9): the package built on the device, the Python GPU attention tests
# and `bench attn` (the op path against SDPA flash and cuDNN in the same run).
cd "$(dirname "$0")/../.." && BARQTRAIN_GIT_COMMIT=572c3d9 CUDA_ARCHS=90a PHASES="build python bench-attn" \
  PYTEST_ARGS="-m gpu -k attention" timeout 580 bash scripts/gpu_check.sh $OUT/check > $OUT/check.out 2>&1
tail -6 $OUT/check.out
