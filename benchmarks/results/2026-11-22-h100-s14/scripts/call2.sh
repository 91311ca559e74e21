#!/usr/bin/env bash
# Session 14, call 2: the branch perf/sm80-tile-orders as it would land (the sm_80 dK/dV kernel
# key block first by key_tile_of_cta, its dQ kernel in QueryTiles' order, the forward as on main;
# the Hopper code moved to tile_order.cuh): the kernel tests with memcheck, racecheck and
# synccheck; harness --general, main (16aa890) against it (harness_e), three rounds; ncu's
# SM-active cycles of its sm_80 dK/dV and dQ kernels.
set -u
cd "$(dirname "$0")" && tar xJf bins2.tar.xz
REPO=$(cd ../.. && pwd)
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
SANITIZE_FILTER='HopperBackward/*many_tiles*:HopperBackward/*packed*:HopperBackward/*_s1:HopperForward/*packed*:AllShapes/AttentionKernel.*packed_many_short:AllShapes/AttentionKernel.*s1000_causal_gqa8:AllShapes/AttentionKernel.*cross_lengths_causal' \
  SANITIZE_TIMEOUT=300 $REPO/scripts/kernel_tests_sharded.sh ./barqtrain_kernel_tests \
  'HopperForward/*:HopperRope/*:HopperBackward/*:AttentionDispatch*:AttentionArguments*:HopperForwardLayout*:HopperBackwardLayout*:AllShapes/*:*TileOrder*:Cases/*' $OUT/tests
echo "tests rc $?"
HARNESS_ARGS=--general $REPO/benchmarks/attention_harness/compare.sh $OUT/harness.log 3 ./harness_main ./harness_e
timeout 60 ncu -k regex:'attention_(dkdv|dq)_kernel' --launch-count 2 --section SpeedOfLight ./harness_e --general > $OUT/ncu_harness_e.txt 2>&1
echo "== ncu harness_e"; grep -E "attention_(dkdv|dq)_kernel|Elapsed Cycles|SM Active Cycles|Duration" $OUT/ncu_harness_e.txt | sed 's/(AttentionParams.*//' | cut -c1-120 | head -8
