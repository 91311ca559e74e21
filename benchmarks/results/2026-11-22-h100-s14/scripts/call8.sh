#!/usr/bin/env bash
# Session 14, call 8: main at e95f8d7 (the sm_80 forward heads innermost), bench attn
REPO=$(cd "$(dirname "$0")/../.." && pwd)
cd $REPO && BARQTRAIN_GIT_COMMIT=e95f8d7 CUDA_ARCHS=90a PHASES="build bench-attn" \
  timeout 560 bash scripts/gpu_check.sh $OUT/check > $OUT/check.out 2>&1
tail -4 $OUT/check.out
