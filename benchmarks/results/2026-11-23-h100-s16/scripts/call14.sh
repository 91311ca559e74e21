#!/usr/bin/env bash
# Session 16, call 14: split barriers at head_dim 64 only (the landed form): kernel tests and the
# harness against f113e26's kernels (h_d96).
set -u
S=.scratch/s16
tar xJf $S/bins14.tar.xz -C $S
bash scripts/kernel_tests_sharded.sh $S/barqtrain_kernel_tests "AllShapes/*:AttentionArguments.*:AttentionDispatch.*" $OUT/tests > $OUT/tests_summary.txt 2>&1
cat $OUT/tests_summary.txt
HARNESS_ARGS=--general bash benchmarks/attention_harness/compare.sh $OUT/compare.log 2 $S/h_d96 $S/h_final > $OUT/compare.txt
cat $OUT/compare.txt
