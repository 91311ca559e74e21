#!/usr/bin/env bash
# Session 13, call 5: the dK/dV launch order chosen on the host (harness_rule) against
# b74738c's (longest first under every causal mask without a window, harness_order), two
# rounds; the backward kernel tests (8 shards); then the package and bench attn.
cd "$(dirname "$0")" && tar xJf bins5.tar.xz
REPO=$(cd ../.. && pwd)
for round in 1 2; do
  for bin in harness_order harness_rule; do
    echo "== $bin round $round" >> $OUT/harness.log
    timeout 100 ./$bin >> $OUT/harness.log 2>&1
  done
done
grep -E "==|causal|full" $OUT/harness.log | grep -v D256 | awk '/==/{b=$2" "$4} !/==/{print b, $1,$2,$3,$4,$5, "fwd", $9, "bwd", $13, "fb", $18, $NF}'
F='HopperBackward/*:AttentionDispatch*:AttentionArguments*:HopperBackwardLayout*:AllShapes/*'
for i in 0 1 2 3 4 5 6 7; do
  GTEST_TOTAL_SHARDS=8 GTEST_SHARD_INDEX=$i timeout 300 ./barqtrain_kernel_tests --gtest_filter="$F" > $OUT/tests_$i.log 2>&1 &
done
wait
cat $OUT/tests_*.log > $OUT/tests.log; rm $OUT/tests_*.log
echo "ok $(grep -c '^\[       OK' $OUT/tests.log) run $(grep -c '^\[ RUN' $OUT/tests.log)"; grep -hE 'FAILED|SKIPPED' $OUT/tests.log | sort | uniq -c | head
cd $REPO && BARQTRAIN_GIT_COMMIT=b7542fe CUDA_ARCHS=90a PHASES="build bench-attn" timeout 400 bash scripts/gpu_check.sh $OUT/check > $OUT/check.out 2>&1; tail -4 $OUT/check.out
