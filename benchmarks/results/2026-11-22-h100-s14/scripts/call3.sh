#!/usr/bin/env bash
# Session 14, call 3: perf/sm80-tile-orders at 7b1c5ae: the package, the Python suite's GPU
# attention tests and bench attn (its barqtrain-general row now the sm_80 path end to end, and
# sdpa-flash-det: FlashAttention-2's deterministic backward).
REPO=$(cd "$(dirname "$0")/../.." && pwd)
cd $REPO && BARQTRAIN_GIT_COMMIT=7b1c5ae CUDA_ARCHS=90a PHASES="build python bench-attn" PYTEST_ARGS="-m gpu -k attention" \
  timeout 580 bash scripts/gpu_check.sh $OUT/check > $OUT/check.out 2>&1
tail -8 $OUT/check.out; grep -E "passed|failed" $OUT/check/gpu_check.log | tail -2
