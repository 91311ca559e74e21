#!/usr/bin/env bash
# Session 12, call 2: harness A (main) / E (steps pipelined, peeled) / F (E + GEMM turns) /
# G (E, the D128 dK/dV role unpipelined), three rounds; SDPA (cuDNN, flash) on the same GPU.
cd "$(dirname "$0")" && tar xJf bins2.tar.xz
REPO=$(cd ../.. && pwd)
for round in 1 2 3; do
  for bin in harness_a harness_e harness_f harness_g; do
    echo "== $bin round $round" >> $OUT/harness.log
    timeout 100 ./$bin >> $OUT/harness.log 2>&1
  done
done
timeout 150 python3 $REPO/benchmarks/attention_harness/sdpa_ref.py > $OUT/sdpa.log 2>&1
grep -E "==|causal|full" $OUT/harness.log | awk '/==/{b=$2" "$4} !/==/{print b, $1,$2,$3,$4,$5, "fwd", $9, "bwd", $13, "fb", $17}'
cat $OUT/sdpa.log | head -12
