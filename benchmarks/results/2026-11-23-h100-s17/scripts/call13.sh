#!/usr/bin/env bash
# Session 17, call 13: bench attn again on main a5011fa (a second run of the final code).
cd "$(dirname "$0")/../.." && BARQTRAIN_GIT_COMMIT=$(cat .scratch/s17/commit) CUDA_ARCHS=90a PHASES="build bench-attn" \
  timeout 500 bash scripts/gpu_check.sh $OUT/check > $OUT/check.out 2>&1
tail -6 $OUT/check.out
