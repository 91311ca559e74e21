#!/usr/bin/env bash
# Session 13, call 7: the D128 dK/dV role's staggered steps. harness_rule = main (b7542fe's
# kernels); stag = step n + 1's S issued behind step n's gradient GEMMs, its dP once they
# retire, P computed under dP's GEMM; stag2 = the same issue order, P and dS computed together
# once dP has landed. Three rounds.
cd "$(dirname "$0")" && tar xJf bins7.tar.xz
for round in 1 2 3; do
  for bin in harness_rule harness_stag harness_stag2; do
    echo "== $bin round $round" >> $OUT/harness.log
    timeout 100 ./$bin >> $OUT/harness.log 2>&1
  done
done
grep -E "==|causal|full" $OUT/harness.log | grep -v D256 | awk '/==/{b=$2" "$4} !/==/{print b, $1,$2,$3,$4,$5, "fwd", $9, "bwd", $13, "fb", $18, $NF}'
