#!/usr/bin/env bash
# Session 14, call 5: bench attn's timing (time_calls) of the general path, SDPA-flash (also
# deterministic) and the Hopper path at B4 S4096 H32/8 D128 causal, with the per-call spread and
# the SM clock and power nvidia-smi samples meanwhile.
REPO=$(cd "$(dirname "$0")/../.." && pwd)
cd $REPO && BARQTRAIN_GIT_COMMIT=7b1c5ae CUDA_ARCHS=90a PHASES="build" timeout 200 bash scripts/gpu_check.sh $OUT/check > $OUT/check.out 2>&1
tail -2 $OUT/check.out
cd /tmp && python3 $REPO/.scratch/s14/timing_probe.py
