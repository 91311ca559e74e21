#!/usr/bin/env bash
# Session 16, call 16 (review): row-stats load templated on the units (the seven-product kernels
# back to their session-start code), the fixed-point dispatch asked once per device. Kernel tests;
# the harness against main's kernels (h_final); both as compute_80 PTX (hashes must match).
set -u
S=.scratch/s16
tar xJf $S/bins16.tar.xz -C $S
bash scripts/kernel_tests_sharded.sh $S/barqtrain_kernel_tests "AllShapes/*:AttentionArguments.*:AttentionDispatch.*" $OUT/tests > $OUT/tests_summary.txt 2>&1
cat $OUT/tests_summary.txt
HARNESS_ARGS=--general bash benchmarks/attention_harness/compare.sh $OUT/compare.log 2 $S/h_final $S/h_review > $OUT/compare.txt
HARNESS_ARGS=--general bash benchmarks/attention_harness/compare.sh $OUT/compare80.log 1 $S/h_d96_ptx80 $S/h_review_ptx80 > $OUT/compare80.txt
cat $OUT/compare.txt $OUT/compare80.txt
