#!/usr/bin/env bash
# Session 16, call 8: the backward kernels' shared key-block walk (KeyBlockSteps, load_keys_values,
# load_queries_gradients) against f113e26's kernels (h_magic); the same tree as compute_80 PTX
# (the seven products through the JIT), whose hashes must equal main's (call 3: 770139ec...).
set -u
S=.scratch/s16
tar xJf $S/bins8.tar.xz -C $S
HARNESS_ARGS=--general bash benchmarks/attention_harness/compare.sh $OUT/compare.log 2 $S/h_magic $S/h_refactor $S/h_refactor_ptx80 > $OUT/compare.txt
cat $OUT/compare.txt
