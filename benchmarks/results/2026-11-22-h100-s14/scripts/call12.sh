#!/usr/bin/env bash
# Session 14, call 12 (review): the sm_80 dQ kernel on the forward's grid (q heads, query blocks,
# batch; branch refactor/sm80-query-grid, harness_h) instead of QueryTiles' divisions, against
# main's kernels (harness_f, e95f8d7), harness --general, three rounds; ncu's dQ cycles; the
# kernel tests of the branch with the sanitizers on the sm_80 cases.
set -u
cd "$(dirname "$0")" && tar xJf bins12.tar.xz
REPO=$(cd ../.. && pwd)
HARNESS_ARGS=--general $REPO/benchmarks/attention_harness/compare.sh $OUT/harness.log 3 ./harness_f ./harness_h | grep -v " D256 "
for bin in harness_f harness_h; do
  timeout 60 ncu -k regex:'attention_dq_kernel' --launch-count 1 --section SpeedOfLight ./$bin --general > $OUT/ncu_$bin.txt 2>&1
  echo "== ncu $bin"; grep -E "Elapsed Cycles|SM Active Cycles" $OUT/ncu_$bin.txt | head -2
done
SANITIZE_FILTER='AllShapes/AttentionKernel.*packed_many_short:AllShapes/AttentionKernel.*s1000_causal_gqa8:AllShapes/AttentionKernel.*cross_lengths_causal' \
  SANITIZE_TIMEOUT=200 $REPO/scripts/kernel_tests_sharded.sh ./barqtrain_kernel_tests \
  'HopperForward/*:HopperRope/*:HopperBackward/*:AttentionDispatch*:AttentionArguments*:AllShapes/*:*TileOrder*:Cases/*:QueryBlockGrid*' $OUT/tests
echo "tests rc $?"
