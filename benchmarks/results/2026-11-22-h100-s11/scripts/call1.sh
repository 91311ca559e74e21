#!/usr/bin/env bash
# Session 11, call 1: harness A (main) against B (persistent forward with a tile counter).
cd "$(dirname "$0")"
for round in 1 2; do
  for bin in harness_a harness_b; do
    echo "== $bin round $round" >> $OUT/harness.log
    timeout 120 ./$bin >> $OUT/harness.log 2>&1
  done
done
cat $OUT/harness.log
cuobjdump -sass harness_b | awk '/Function :/{f=$3} /LDL|STL/{n[f]++} END{for (k in n) print n[k], k}' | grep -i forward | head
