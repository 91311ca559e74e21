#!/usr/bin/env bash
# Session 17, call 4: kernel tests and sanitizers on the one-bulk + runs-of-4-pairs + step-cursor
# tree; harness: main, onebulk (+ norms), runs (onebulk + pairs together in runs), cursor (runs +
# no divisions per step); per-kernel times of cursor.
set -u
tar -xJf .scratch/s17/v4.tar.xz -C .scratch/s17; V=.scratch/s17/v4
SANITIZE_TIMEOUT=300 SANITIZE_FILTER="AllShapes/AttentionKernel.*packed_many_short:AllShapes/AttentionKernel.*bf16_s1000_causal_gqa8:AllShapes/AttentionKernel.*bf16_cross_lengths_causal:AllShapes/AttentionKernel.*bf16_packed_rope_positions:AllShapes/AttentionKernel.*fp16_softcap50_window:AllShapes/AttentionKernel.*bf16_d96_causal_gqa4:AllShapes/AttentionKernel.*bf16_d64_full_s17" \
  bash scripts/kernel_tests_sharded.sh $V/barqtrain_kernel_tests "AllShapes/*:AttentionArguments.*:AttentionDispatch.*:KeyTileOrder*" $OUT/tests > $OUT/tests_summary.txt 2>&1
cat $OUT/tests_summary.txt
HARNESS_ARGS=--general bash benchmarks/attention_harness/compare.sh $OUT/harness.log 2 $V/main $V/onebulk $V/runs $V/cursor
for b in runs cursor; do
  timeout 100 ncu --metrics gpu__time_duration.sum,dram__bytes_read.sum --cache-control none --clock-control none \
    -k regex:'attention_(kv_norms|dot|gradients|dq_from)' --launch-count 4 $V/$b --general > $OUT/ncu_$b.txt 2>&1
  echo "== $b"; grep -E "gpu__|dram__" $OUT/ncu_$b.txt | awk '{print $1, $2, $3}' | tr '\n' ' '; echo
done
