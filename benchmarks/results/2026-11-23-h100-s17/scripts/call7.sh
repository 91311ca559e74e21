#!/usr/bin/env bash
# Session 17, call 7: `bench attn` twice in a row on main d00b307 (call 5's run read the D128
# causal case 11% below the harness and below flash; call 6's bench timing of that case alone did not).
cd "$(dirname "$0")/../.." && BARQTRAIN_GIT_COMMIT=$(cat .scratch/s17/commit) CUDA_ARCHS=90a PHASES="build bench-attn" \
  timeout 330 bash scripts/gpu_check.sh $OUT/check > $OUT/check.out 2>&1
tail -3 $OUT/check.out
mv $OUT/check/bench/attn.json $OUT/attn_run1.json
C=$(cat .scratch/s17/commit); (cd /tmp && BARQTRAIN_GIT_COMMIT=$C timeout 240 python3 -m barqtrain.cli bench attn --out $OUT/run2 > $OUT/run2.log 2>&1); tail -2 $OUT/run2.log
mv $OUT/run2/attn.json $OUT/attn_run2.json
