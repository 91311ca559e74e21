#!/usr/bin/env bash
# Session 11 review, call 10: the shared tile walk (420df54..): kernel tests in 8 shards,
# sanitizers on the cases with more tiles than SMs, harness main (f912ce4) against the review's tree.
cd "$(dirname "$0")" && tar xJf bins.tar.xz
F='HopperForward/*:HopperRope/*:HopperBackward/*:AttentionDispatch*:AttentionArguments*:HopperForwardLayout*:HopperBackwardLayout*:AllShapes/*'
for i in 0 1 2 3 4 5 6 7; do
  GTEST_TOTAL_SHARDS=8 GTEST_SHARD_INDEX=$i timeout 420 ./barqtrain_kernel_tests --gtest_filter="$F" > $OUT/tests_$i.log 2>&1 &
done
wait
cat $OUT/tests_*.log > $OUT/tests.log; rm $OUT/tests_*.log
echo "ok $(grep -c '^\[       OK' $OUT/tests.log) run $(grep -c '^\[ RUN' $OUT/tests.log)"; grep -hE 'FAILED|SKIPPED|PASSED' $OUT/tests.log | sort | uniq -c
SAN='*many_tiles*:HopperBackward/*packed*:HopperForward/*cross_lengths*'
for tool in memcheck racecheck; do
  timeout 200 compute-sanitizer --tool $tool --error-exitcode 1 ./barqtrain_kernel_tests --gtest_filter="$SAN" > $OUT/$tool.log 2>&1
  echo "$tool rc $?" >> $OUT/$tool.log; tail -2 $OUT/$tool.log
done
for round in 1 2; do
  for bin in harness_main harness_r; do
    echo "== $bin round $round" >> $OUT/harness.log
    timeout 120 ./$bin >> $OUT/harness.log 2>&1
  done
done
cat $OUT/harness.log
