#!/usr/bin/env bash
# Session 17, call 6: why bench attn reads the D128 general backward 0.8 ms slower than the
# harness: the package's kernels through the op (profiler, bench timing, clocks) and the harness.
cd "$(dirname "$0")/../.." && BARQTRAIN_GIT_COMMIT=$(cat .scratch/s17/commit) CUDA_ARCHS=90a PHASES="build" \
  timeout 300 bash scripts/gpu_check.sh $OUT/check > $OUT/check.out 2>&1
tail -3 $OUT/check.out
S=$(pwd)/.scratch/s17
(cd /tmp && timeout 150 python3 $S/sustained.py 128) 2>&1 | tee $OUT/sustained.txt | grep -v Warn
nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 100 > $OUT/smi_harness.txt &
tar -xJf $S/v4.tar.xz -C $S && timeout 100 $S/v4/cursor --general | head -3
kill %1
for f in $OUT/smi_*.txt; do echo "$f: $(awk -F, '{c+=$1; p+=$2; n++} END {printf "%d samples, SM %.0f MHz, %.0f W", n, c/n, p/n}' $f)"; done
