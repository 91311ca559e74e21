#!/usr/bin/env bash
# Session 13, call 1: the dK/dV kernel's tile order. Harness A (main), pairs (key blocks j and
# last - j per CTA), lpt (one key block per CTA, key-block-major launch order), three rounds;
# SDPA in the same call; ncu's SM-active vs elapsed cycles of the dK/dV kernel (first case).
cd "$(dirname "$0")" && tar xJf bins1.tar.xz
REPO=$(cd ../.. && pwd)
for round in 1 2 3; do
  for bin in harness_a harness_pairs harness_lpt; do
    echo "== $bin round $round" >> $OUT/harness.log
    timeout 100 ./$bin >> $OUT/harness.log 2>&1
  done
done
timeout 150 python3 $REPO/benchmarks/attention_harness/sdpa_ref.py > $OUT/sdpa.log 2>&1
grep -E "==|causal|full" $OUT/harness.log | awk '/==/{b=$2" "$4} !/==/{print b, $1,$2,$3,$4,$5, "fwd", $9, "bwd", $13, "fb", $18, $NF}'
head -8 $OUT/sdpa.log
for bin in harness_a harness_pairs harness_lpt; do
  timeout 120 ncu -k regex:attention_backward_sm90 --launch-count 2 --section SpeedOfLight --section LaunchStats \
    ./$bin > $OUT/ncu_$bin.txt 2>&1
  echo "== ncu $bin"; grep -E "attention_backward|Elapsed Cycles|SM Active Cycles|Duration|Grid Size" $OUT/ncu_$bin.txt | head -12
done
