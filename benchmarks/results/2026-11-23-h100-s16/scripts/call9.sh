#!/usr/bin/env bash
# Session 16, call 9: the shared key-block walk with KeyBlockSteps keeping kv_head and group
# (no spill) against f113e26 (h_magic), and both as compute_80 PTX (the seven products).
set -u
S=.scratch/s16
tar xJf $S/bins9.tar.xz -C $S
HARNESS_ARGS=--general bash benchmarks/attention_harness/compare.sh $OUT/compare.log 2 $S/h_magic $S/h_refactor2 $S/h_head_ptx80 $S/h_refactor2_ptx80 > $OUT/compare.txt
cat $OUT/compare.txt
