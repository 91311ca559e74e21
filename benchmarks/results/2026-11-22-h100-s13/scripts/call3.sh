#!/usr/bin/env bash
# Session 13, call 3: query tiles (forward, dQ kernel) longest first under a causal mask
# (harness_q) against main with the dK/dV order (harness_order), three rounds.
cd "$(dirname "$0")" && tar xJf bins3.tar.xz
for round in 1 2 3; do
  for bin in harness_order harness_q; do
    echo "== $bin round $round" >> $OUT/harness.log
    timeout 100 ./$bin >> $OUT/harness.log 2>&1
  done
done
grep -E "==|causal|full" $OUT/harness.log | awk '/==/{b=$2" "$4} !/==/{print b, $1,$2,$3,$4,$5, "fwd", $9, "bwd", $13, "fb", $18, $NF}'
