#!/usr/bin/env bash
# Session 11, call 2: the persistent forward's tests and sanitizers, harness A/B, SDPA.
cd "$(dirname "$0")"
REPO=$(cd ../.. && pwd)
F='HopperForward/*:HopperRope/*:HopperBackward/*:AttentionDispatch*:AttentionArguments*:HopperForwardLayout*:HopperBackwardLayout*:AllShapes/*cross_lengths*'
timeout 300 ./barqtrain_kernel_tests --gtest_filter="$F" > $OUT/tests.log 2>&1
echo "tests rc $?" >> $OUT/tests.log
tail -3 $OUT/tests.log; grep -cE '^\[       OK' $OUT/tests.log; grep -E 'SKIPPED|FAILED' $OUT/tests.log | head
SAN='HopperForward/*many_tiles*:HopperForward/*hopper_bf16_packed_cross_lengths_causal:HopperForward/*hopper_bf16_d256_forward'
for tool in memcheck racecheck synccheck; do
  timeout 200 compute-sanitizer --tool $tool --error-exitcode 1 ./barqtrain_kernel_tests --gtest_filter="$SAN" > $OUT/$tool.log 2>&1
  echo "$tool rc $?" >> $OUT/$tool.log
  tail -2 $OUT/$tool.log
done
for round in 1 2; do
  for bin in harness_a harness_b; do
    echo "== $bin round $round" >> $OUT/harness.log
    timeout 120 ./$bin >> $OUT/harness.log 2>&1
  done
done
cat $OUT/harness.log
timeout 100 python3 $REPO/benchmarks/attention_harness/sdpa_ref.py > $OUT/sdpa.log 2>&1
echo "sdpa rc $?" >> $OUT/sdpa.log
cat $OUT/sdpa.log
cuobjdump -sass harness_b | awk '/Function :/{f=$3} /LDL|STL/{n[f]++} END{for (k in n) print n[k], k}' | grep -i sm90 | head
