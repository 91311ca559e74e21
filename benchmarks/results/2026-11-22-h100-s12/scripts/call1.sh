#!/usr/bin/env bash
# Session 12, call 1: harness A (main) / B (GEMM turns) / C (B + steps pipelined) / D (C, the
# D128 dK/dV role unpipelined), three rounds; then D's backward tests (8 shards) and racecheck /
# synccheck on the backward's packed, cross-length and many-tile cases.
cd "$(dirname "$0")" && tar xJf bins.tar.xz
for round in 1 2 3; do
  for bin in harness_a harness_b harness_c harness_d; do
    echo "== $bin round $round" >> $OUT/harness.log
    timeout 100 ./$bin >> $OUT/harness.log 2>&1
  done
done
F='HopperBackward/*:HopperRope/*:AttentionDispatch*:AttentionArguments*:HopperBackwardLayout*'
for i in 0 1 2 3 4 5 6 7; do
  GTEST_TOTAL_SHARDS=8 GTEST_SHARD_INDEX=$i timeout 200 ./barqtrain_kernel_tests --gtest_filter="$F" > $OUT/tests_$i.log 2>&1 &
done
wait
cat $OUT/tests_*.log > $OUT/tests.log; rm $OUT/tests_*.log
echo "ok $(grep -c '^\[       OK' $OUT/tests.log) run $(grep -c '^\[ RUN' $OUT/tests.log)"; grep -hE 'FAILED|SKIPPED|PASSED' $OUT/tests.log | sort | uniq -c | head -20
SAN='HopperBackward/*many_tiles*:HopperBackward/*packed*:HopperBackward/*cross_lengths*:HopperBackward/*_s1'
for tool in racecheck synccheck; do
  timeout 90 compute-sanitizer --tool $tool --error-exitcode 1 ./barqtrain_kernel_tests --gtest_filter="$SAN" > $OUT/$tool.log 2>&1
  echo "$tool rc $?" >> $OUT/$tool.log
  tail -2 $OUT/$tool.log
done
cat $OUT/harness.log
