#!/usr/bin/env bash
# Session 12, call 3: harness A (main) / A3 (main, 3 stream stages) / H (steps pipelined, 3 stages) / I (H, D128 dK/dV unpipelined)
cd "$(dirname "$0")" && tar xJf bins3.tar.xz
REPO=$(cd ../.. && pwd)
for round in 1 2 3; do
  for bin in harness_a harness_a3 harness_h harness_i; do
    echo "== $bin round $round" >> $OUT/harness.log
    timeout 100 ./$bin >> $OUT/harness.log 2>&1
  done
done
grep -E "==|causal|full" $OUT/harness.log | awk '/==/{b=$2" "$4} !/==/{print b, $1,$2,$3,$4,$5, "fwd", $9, "bwd", $13, "fb", $18, $NF}'
