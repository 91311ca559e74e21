#!/usr/bin/env bash
# Session 16, call 10: head_dim 96 (cases added to the harness), the fixed-point backward
# (main, sm_90a) against the seven products (the same tree as compute_80 PTX).
set -u
S=.scratch/s16
tar xJf $S/bins10.tar.xz -C $S
HARNESS_ARGS=--general bash benchmarks/attention_harness/compare.sh $OUT/compare.log 2 $S/h_d96 $S/h_d96_ptx80 > $OUT/compare.txt
grep -E "D96|D128 causal" $OUT/compare.txt
