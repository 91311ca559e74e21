#!/usr/bin/env bash
# Session 14, call 7: the sm_80 forward's grid as (q heads, query blocks, batch): a sequence's
# query blocks from the last, every head's at each (harness_f), against main at c6eb531
# (harness_e: its kernels are dcd10a2's), harness --general, three rounds; ncu's SM-active cycles
# of the forward at the first case; the kernel tests of the branch with memcheck, racecheck and
# synccheck on the sm_80 cases.
set -u
cd "$(dirname "$0")" && tar xJf bins7.tar.xz
REPO=$(cd ../.. && pwd)
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
HARNESS_ARGS=--general $REPO/benchmarks/attention_harness/compare.sh $OUT/harness.log 3 ./harness_e ./harness_f | grep -v " D256 "
for bin in harness_e harness_f; do
  timeout 60 ncu -k regex:'attention_forward_kernel' --launch-count 1 --section SpeedOfLight ./$bin --general > $OUT/ncu_$bin.txt 2>&1
  echo "== ncu $bin"; grep -E "Elapsed Cycles|SM Active Cycles|Duration" $OUT/ncu_$bin.txt | head -3
done
SANITIZE_FILTER='AllShapes/AttentionKernel.*packed_many_short:AllShapes/AttentionKernel.*s1000_causal_gqa8:AllShapes/AttentionKernel.*cross_lengths_causal:AllShapes/AttentionKernel.*d256_forward_rope_softcap' \
  SANITIZE_TIMEOUT=200 $REPO/scripts/kernel_tests_sharded.sh ./barqtrain_kernel_tests \
  'HopperForward/*:HopperRope/*:HopperBackward/*:AttentionDispatch*:AttentionArguments*:AllShapes/*:*TileOrder*:Cases/*' $OUT/tests
echo "tests rc $?"
