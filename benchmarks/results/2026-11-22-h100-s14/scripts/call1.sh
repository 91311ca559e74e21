#!/usr/bin/env bash
# Session 14, call 1: the sm_80 kernels' tile orders, harness --general, three rounds: main
# (16aa890) against A (146c1c1: forward and dQ in QueryTiles' order, dK/dV key block first by
# key_tile_of_cta), C (dK/dV alone, key block first by a swapped grid, chosen at run time) and D
# (the same, chosen at compile time); ncu's SM-active cycles of the sm_80 dK/dV and dQ kernels
# at the first case; SDPA flash, flash under torch.use_deterministic_algorithms and cuDNN.
set -u
cd "$(dirname "$0")" && tar xJf bins1.tar.xz
REPO=$(cd ../.. && pwd)
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
HARNESS_ARGS=--general $REPO/benchmarks/attention_harness/compare.sh $OUT/harness.log 3 \
  ./harness_main ./harness_orders ./harness_c ./harness_d
for bin in harness_main harness_orders harness_d; do
  timeout 60 ncu -k regex:'attention_(dkdv|dq)_kernel' --launch-count 2 --section SpeedOfLight ./$bin --general > $OUT/ncu_$bin.txt 2>&1
  echo "== ncu $bin"; grep -E "attention_(dkdv|dq)_kernel|Elapsed Cycles|SM Active Cycles|Duration" $OUT/ncu_$bin.txt | sed 's/(AttentionParams.*//' | cut -c1-120 | head -8
done
timeout 150 python $REPO/benchmarks/attention_harness/sdpa_ref.py > $OUT/sdpa.log 2>&1; echo "sdpa rc $?"; cat $OUT/sdpa.log
