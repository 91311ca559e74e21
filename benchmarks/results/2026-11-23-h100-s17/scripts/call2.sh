#!/usr/bin/env bash
# Session 17, call 2: the gradients kernel's CTA order (longest first / head after head / super-
# groups of 4 kv heads) and step order (head outer ascending / query outer descending, heads inner).
set -u
tar -xJf .scratch/s17/v2.tar.xz -C .scratch/s17; V=.scratch/s17/v2
for b in main hh desc hh_desc super super_desc; do
  timeout 100 ncu --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,sm__cycles_active.avg,sm__cycles_elapsed.max \
    --cache-control none --clock-control none -k regex:attention_gradients --launch-count 1 $V/$b --general > $OUT/ncu_$b.txt 2>&1
  echo "== $b"; grep -E "gpu__|dram__|lts__|sm__" $OUT/ncu_$b.txt
done
HARNESS_ARGS=--general bash benchmarks/attention_harness/compare.sh $OUT/harness.log 2 $V/main $V/hh $V/desc $V/hh_desc $V/super $V/super_desc
