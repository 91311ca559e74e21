#!/usr/bin/env bash
# Session 16, call 6: dQ's fixed-point rounding by one fma (branch perf/sm80-bwd-fixed-point-fma,
# 4143839): kernel tests against float64, then the harness against the landed kernels (h_fp).
set -u
S=.scratch/s16
tar xJf $S/bins6.tar.xz -C $S
bash scripts/kernel_tests_sharded.sh $S/barqtrain_kernel_tests "AllShapes/*:AttentionArguments.*:AttentionDispatch.*" $OUT/tests > $OUT/tests_summary.txt 2>&1
cat $OUT/tests_summary.txt
HARNESS_ARGS=--general bash benchmarks/attention_harness/compare.sh $OUT/compare.log 3 $S/h_fp $S/h_magic > $OUT/compare.txt
cat $OUT/compare.txt
