#!/usr/bin/env bash
# Session 16, call 13: the P and dS barriers split into arrive and wait (branch
# perf/sm80-bwd-split-barrier): kernel tests, the three sanitizers on 5 shapes, and the harness
# against main's kernels (h_d96 = f113e26's, with the D96 cases).
set -u
S=.scratch/s16
tar xJf $S/bins13.tar.xz -C $S
SANITIZE_TIMEOUT=300 SANITIZE_FILTER="AllShapes/AttentionKernel.*packed_many_short:AllShapes/AttentionKernel.*bf16_s1000_causal_gqa8:AllShapes/AttentionKernel.*bf16_packed_rope_positions:AllShapes/AttentionKernel.*fp16_softcap50_window:AllShapes/AttentionKernel.*bf16_d64_full_s17" \
  bash scripts/kernel_tests_sharded.sh $S/barqtrain_kernel_tests "AllShapes/*:AttentionArguments.*:AttentionDispatch.*" $OUT/tests > $OUT/tests_summary.txt 2>&1
cat $OUT/tests_summary.txt
HARNESS_ARGS=--general bash benchmarks/attention_harness/compare.sh $OUT/compare.log 2 $S/h_d96 $S/h_split > $OUT/compare.txt
cat $OUT/compare.txt
