#!/usr/bin/env bash
# Session 17, call 11: the first step's loads in two groups (K, Q, stats; then V, dO behind
# the first S): kernel tests and sanitizers; harness against main (f1dc59c).
set -u
tar -xJf .scratch/s17/v11.tar.xz -C .scratch/s17; V=.scratch/s17/v11
SANITIZE_TIMEOUT=240 SANITIZE_FILTER="AllShapes/AttentionKernel.*packed_many_short:AllShapes/AttentionKernel.*bf16_s1000_causal_gqa8:AllShapes/AttentionKernel.*bf16_packed_rope_positions:AllShapes/AttentionKernel.*bf16_d64_full_s17" \
  bash scripts/kernel_tests_sharded.sh $V/barqtrain_kernel_tests "AllShapes/*:AttentionArguments.*:AttentionDispatch.*:KeyTileOrder*" $OUT/tests > $OUT/tests_summary.txt 2>&1
cat $OUT/tests_summary.txt
HARNESS_ARGS=--general bash benchmarks/attention_harness/compare.sh $OUT/harness.log 3 $V/main $V/split
