#!/usr/bin/env bash
# Session 16, call 1: the square-tile sm_80 backward (branch perf/sm80-bwd-square-tiles) against
# float64 (kernel tests) and against main and session 15's 8-warp bulk kernel (harness --general).
set -u
S=.scratch/s16
tar xJf $S/bins1.tar.xz -C $S
nvidia-smi --query-gpu=name,clocks.max.sm,driver_version --format=csv > $OUT/gpu.txt
bash scripts/kernel_tests_sharded.sh $S/barqtrain_kernel_tests "AllShapes/*:AttentionArguments.*:AttentionDispatch.*" $OUT/tests > $OUT/tests_summary.txt 2>&1
cat $OUT/tests_summary.txt
HARNESS_ARGS=--general bash benchmarks/attention_harness/compare.sh $OUT/compare.log 2 $S/harness_main $S/harness_bulk $S/h_square > $OUT/compare.txt
cat $OUT/compare.txt
