#!/usr/bin/env bash
# Session 13, call 13: main at 2786512's kernels: the end-to-end LoRA step, Llama-3.2-1B shape
# (4 x 2048) and Llama-3.1-8B shape (2 x 4096, checkpointing), with and without the attention op.
REPO=$(cd "$(dirname "$0")/../.." && pwd)
cd $REPO && BARQTRAIN_GIT_COMMIT=a2de302 CUDA_ARCHS=90a PHASES="build" bash scripts/gpu_check.sh $OUT/check > $OUT/check.out 2>&1; tail -1 $OUT/check.out
cd /tmp
for model in llama-1b llama-8b; do
  start=$SECONDS
  BARQTRAIN_GIT_COMMIT=a2de302 timeout 250 python3 -m barqtrain.cli bench e2e --models $model --compare hf --steps 10 --warmup 2 \
    --out $OUT/e2e-$model > $OUT/e2e-$model.log 2>&1
  echo "e2e $model rc $? in $((SECONDS - start)) s" >> $OUT/e2e-$model.log
  tail -7 $OUT/e2e-$model.log
done
