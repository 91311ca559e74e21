#!/usr/bin/env bash
# Session 16, call 11: ncu source counters of the landed gradients kernel (f113e26's kernels,
# B4 S4096 H32/8 D128 causal, the harness's first backward), per CUDA source line.
set -u
S=.scratch/s16
tar xJf $S/bins11.tar.xz -C $S
timeout 300 ncu --kernel-name regex:attention_gradients_kernel --launch-count 1 --section SourceCounters \
  --section WarpStateStats --import-source yes -o $OUT/prof $S/h_magic --general > $OUT/ncu.log 2>&1
ncu -i $OUT/prof.ncu-rep --page source --csv --print-source cuda > $OUT/source_cuda.csv 2> $OUT/source_err.txt
ncu -i $OUT/prof.ncu-rep --page details --section WarpStateStats --print-details all > $OUT/stalls.txt 2>&1
wc -l $OUT/source_cuda.csv; head -c 600 $OUT/source_cuda.csv; tail -3 $OUT/source_err.txt
