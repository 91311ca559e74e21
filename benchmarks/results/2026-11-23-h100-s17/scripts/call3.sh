#!/usr/bin/env bash
# Session 17, call 3: dQ sums in one bulk reduction per step (workspace rows padded as the
# staging tile), the norms kernel's atomics per 16 rows; issue variants.
set -u
tar -xJf .scratch/s17/v3.tar.xz -C .scratch/s17; V=.scratch/s17/v3
for b in main old_issue single elect single_w7; do
  timeout 100 ncu --metrics gpu__time_duration.sum --cache-control none --clock-control none \
    -k regex:'attention_(kv_norms|dot|gradients|dq_from)' --launch-count 4 $V/$b --general > $OUT/ncu_$b.txt 2>&1
  echo "== $b"; grep -E "gpu__" $OUT/ncu_$b.txt | awk '{print $2, $3}' | tr '\n' ' '; echo
done
HARNESS_ARGS=--general bash benchmarks/attention_harness/compare.sh $OUT/harness.log 2 $V/main $V/old_issue $V/single $V/elect $V/single_w7
