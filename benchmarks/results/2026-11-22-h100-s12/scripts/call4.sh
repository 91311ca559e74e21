#!/usr/bin/env bash
# Session 12, call 4: the pipelined backward (J, branch perf/hopper-bwd-pipelined): kernel tests
# (8 shards), memcheck / racecheck / synccheck on the backward's packed, cross-length, one-token
# and many-tile cases; harness A (main) / J / K (J with 32 streamed rows and pipelining in the
# D128 dK/dV role), three rounds; SDPA (cuDNN, flash) in the same call.
cd "$(dirname "$0")" && tar xJf bins4.tar.xz
REPO=$(cd ../.. && pwd)
F='HopperForward/*:HopperRope/*:HopperBackward/*:AttentionDispatch*:AttentionArguments*:HopperForwardLayout*:HopperBackwardLayout*:AllShapes/*'
for i in 0 1 2 3 4 5 6 7; do
  GTEST_TOTAL_SHARDS=8 GTEST_SHARD_INDEX=$i timeout 300 ./barqtrain_kernel_tests --gtest_filter="$F" > $OUT/tests_$i.log 2>&1 &
done
wait
cat $OUT/tests_*.log > $OUT/tests.log; rm $OUT/tests_*.log
echo "ok $(grep -c '^\[       OK' $OUT/tests.log) run $(grep -c '^\[ RUN' $OUT/tests.log)"; grep -hE 'FAILED|SKIPPED|PASSED' $OUT/tests.log | sort | uniq -c | head -20
SAN='HopperBackward/*many_tiles*:HopperBackward/*packed*:HopperBackward/*cross_lengths*:HopperBackward/*_s1'
for tool in memcheck racecheck synccheck; do
  timeout 100 compute-sanitizer --tool $tool --error-exitcode 1 ./barqtrain_kernel_tests --gtest_filter="$SAN" > $OUT/$tool.log 2>&1
  echo "$tool rc $?" >> $OUT/$tool.log
  tail -2 $OUT/$tool.log
done
for round in 1 2 3; do
  for bin in harness_a harness_j harness_k; do
    echo "== $bin round $round" >> $OUT/harness.log
    timeout 100 ./$bin >> $OUT/harness.log 2>&1
  done
done
timeout 150 python3 $REPO/benchmarks/attention_harness/sdpa_ref.py > $OUT/sdpa.log 2>&1
grep -E "==|causal|full" $OUT/harness.log | awk '/==/{b=$2" "$4} !/==/{print b, $1,$2,$3,$4,$5, "fwd", $9, "bwd", $13, "fb", $18, $NF}'
head -6 $OUT/sdpa.log
