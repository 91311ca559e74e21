#!/usr/bin/env bash
# Session 13, call 2: the dK/dV kernel's launch order (key block first under a causal mask):
# harness A (main) / order, three rounds, SDPA in the same call; then the Hopper and AllShapes
# kernel tests (8 shards) and memcheck / racecheck / synccheck on the backward's many-tile,
# packed, cross-length and one-token cases, in parallel.
cd "$(dirname "$0")" && tar xJf bins2.tar.xz
REPO=$(cd ../.. && pwd)
for round in 1 2 3; do
  for bin in harness_a harness_order; do
    echo "== $bin round $round" >> $OUT/harness.log
    timeout 100 ./$bin >> $OUT/harness.log 2>&1
  done
done
timeout 150 python3 $REPO/benchmarks/attention_harness/sdpa_ref.py > $OUT/sdpa.log 2>&1
grep -E "==|causal|full" $OUT/harness.log | grep -v D256 | awk '/==/{b=$2" "$4} !/==/{print b, $1,$2,$3,$4,$5, "fwd", $9, "bwd", $13, "fb", $18, $NF}'
head -8 $OUT/sdpa.log
F='HopperForward/*:HopperRope/*:HopperBackward/*:AttentionDispatch*:AttentionArguments*:HopperForwardLayout*:HopperBackwardLayout*:AllShapes/*'
SAN='HopperBackward/*many_tiles*:HopperBackward/*packed*:HopperBackward/*cross_lengths*:HopperBackward/*_s1'
for tool in memcheck racecheck synccheck; do
  (timeout 400 compute-sanitizer --tool $tool --error-exitcode 1 ./barqtrain_kernel_tests --gtest_filter="$SAN" > $OUT/$tool.log 2>&1
   echo "$tool rc $?" >> $OUT/$tool.log) &
done
for i in 0 1 2 3 4 5 6 7; do
  GTEST_TOTAL_SHARDS=8 GTEST_SHARD_INDEX=$i timeout 300 ./barqtrain_kernel_tests --gtest_filter="$F" > $OUT/tests_$i.log 2>&1 &
done
wait
cat $OUT/tests_*.log > $OUT/tests.log; rm $OUT/tests_*.log
echo "ok $(grep -c '^\[       OK' $OUT/tests.log) run $(grep -c '^\[ RUN' $OUT/tests.log)"; grep -hE 'FAILED|SKIPPED|PASSED' $OUT/tests.log | sort | uniq -c | head -20
for tool in memcheck racecheck synccheck; do tail -2 $OUT/$tool.log; done
