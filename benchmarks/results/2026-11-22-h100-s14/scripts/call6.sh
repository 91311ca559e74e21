#!/usr/bin/env bash
# Session 14, call 6: main at 7b1c5ae, bench attn again (call 3's ran on a machine where every
# row read 5-15% below calls 4-5).
REPO=$(cd "$(dirname "$0")/../.." && pwd)
cd $REPO && BARQTRAIN_GIT_COMMIT=7b1c5ae CUDA_ARCHS=90a PHASES="build bench-attn" \
  timeout 560 bash scripts/gpu_check.sh $OUT/check > $OUT/check.out 2>&1
tail -4 $OUT/check.out
