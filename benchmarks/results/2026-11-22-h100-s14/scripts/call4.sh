#!/usr/bin/env bash
# Session 14, call 4: why bench attn's barqtrain-general row (the sm_80 path through the op,
# 204 TFLOP/s forward+backward in call 3) sits below the harness's (238, call 2). Same machine:
# the harness at the branch (harness_e), then the op's general path and SDPA through
# attention_profile.py (CUDA events, one call each after warm-up), then ncu's duration of every
# kernel of one op call.
REPO=$(cd "$(dirname "$0")/../.." && pwd)
cd "$(dirname "$0")" && tar xJf bins2.tar.xz harness_e
cd $REPO && BARQTRAIN_GIT_COMMIT=7b1c5ae CUDA_ARCHS=90a PHASES="build" timeout 200 bash scripts/gpu_check.sh $OUT/check > $OUT/check.out 2>&1
tail -3 $OUT/check.out
$REPO/.scratch/s14/harness_e --general 2>&1 | head -4
cd /tmp
for i in 1 2; do python3 $REPO/scripts/diagnostics/attention_profile.py --impl barqtrain-general sdpa-flash sdpa-flash-det barqtrain-hopper; done
timeout 120 ncu --profile-from-start off --metrics gpu__time_duration.sum python3 $REPO/scripts/diagnostics/attention_profile.py --impl barqtrain-general > $OUT/ncu_op_general.txt 2>&1
grep -E "^  [a-zA-Z_].*\(|gpu__time_duration" $OUT/ncu_op_general.txt | sed 's/(AttentionParams.*//' | cut -c1-110
timeout 60 ncu --metrics gpu__time_duration.sum -k regex:attention --launch-count 4 $REPO/.scratch/s14/harness_e --general > $OUT/ncu_harness_general.txt 2>&1
grep -E "^  [a-zA-Z_].*\(|gpu__time_duration" $OUT/ncu_harness_general.txt | sed 's/(AttentionParams.*//' | cut -c1-110 | head -16
