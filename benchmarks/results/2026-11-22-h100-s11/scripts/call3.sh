#!/usr/bin/env bash
# Session 11, call 3: the combined tree's kernel tests (persistent forward + D in the dQ kernel, e5fcd0e..a6dcec9) (8 shards at once), backward sanitizers,
# harness A (main) / B (persistent forward) / C (B + the dQ kernel computing D), SDPA.
cd "$(dirname "$0")" && tar xJf bins.tar.xz
REPO=$(cd ../.. && pwd)
F='HopperForward/*:HopperRope/*:HopperBackward/*:AttentionDispatch*:AttentionArguments*:HopperForwardLayout*:HopperBackwardLayout*:AllShapes/*'
for i in 0 1 2 3 4 5 6 7; do
  GTEST_TOTAL_SHARDS=8 GTEST_SHARD_INDEX=$i timeout 420 ./barqtrain_kernel_tests --gtest_filter="$F" > $OUT/tests_$i.log 2>&1 &
done
wait
cat $OUT/tests_*.log > $OUT/tests.log
echo "ok $(grep -c '^\[       OK' $OUT/tests.log) run $(grep -c '^\[ RUN' $OUT/tests.log)"; grep -hE 'FAILED|SKIPPED|PASSED' $OUT/tests_*.log | sort | uniq -c | head -20
SAN='HopperBackward/*packed*:HopperBackward/*cross_lengths*:HopperBackward/*_s1'
for tool in memcheck racecheck; do
  timeout 150 compute-sanitizer --tool $tool --error-exitcode 1 ./barqtrain_kernel_tests --gtest_filter="$SAN" > $OUT/$tool.log 2>&1
  echo "$tool rc $?" >> $OUT/$tool.log
  tail -2 $OUT/$tool.log
done
for round in 1 2; do
  for bin in harness_a harness_b harness_c; do
    echo "== $bin round $round" >> $OUT/harness.log
    timeout 120 ./$bin >> $OUT/harness.log 2>&1
  done
done
cat $OUT/harness.log
timeout 100 python3 $REPO/benchmarks/attention_harness/sdpa_ref.py > $OUT/sdpa.log 2>&1
head -8 $OUT/sdpa.log
