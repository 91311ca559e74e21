#!/usr/bin/env bash
# Session 16, call 5: S and dP in one loop (branch perf/sm80-bwd-fused-sdp) against the landed
# kernels (h_fp, 572c3d9 = 90efc93's kernels).
set -u
S=.scratch/s16
tar xJf $S/bins5.tar.xz -C $S
HARNESS_ARGS=--general bash benchmarks/attention_harness/compare.sh $OUT/compare.log 3 $S/h_fp $S/h_fused > $OUT/compare.txt
cat $OUT/compare.txt
