#!/usr/bin/env bash
# Session 13, call 10: query tiles (the persistent forward and dQ kernel) numbered a GQA group
# after another, the group's heads in turn at each query block (harness_grouped), against main
# (harness_rule), three rounds; ncu's SM-active cycles of both kernels at the first case.
cd "$(dirname "$0")" && tar xJf bins10.tar.xz
REPO=$(cd ../.. && pwd)
$REPO/benchmarks/attention_harness/compare.sh $OUT/harness.log 3 ./harness_rule ./harness_grouped
for bin in harness_rule harness_grouped; do
  for kernel in forward_sm90 backward_sm90; do
    timeout 100 ncu -k regex:attention_$kernel --launch-count 1 --section SpeedOfLight ./$bin > $OUT/ncu_${bin}_$kernel.txt 2>&1
    echo "== ncu $bin $kernel"; grep -E "Elapsed Cycles|SM Active Cycles|Duration" $OUT/ncu_${bin}_$kernel.txt | head -3
  done
done
