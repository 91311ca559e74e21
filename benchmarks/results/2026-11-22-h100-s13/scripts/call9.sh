#!/usr/bin/env bash
# Session 13, call 9: main at 6d82aa8: the end-to-end LoRA step on the Llama-3.1-8B shape with and
# without the attention op (2 x 4096 tokens, checkpointing, as session 12's call 7).
REPO=$(cd "$(dirname "$0")/../.." && pwd)
cd $REPO && BARQTRAIN_GIT_COMMIT=6d82aa8 CUDA_ARCHS=90a PHASES="build" bash scripts/gpu_check.sh $OUT/check > $OUT/check.out 2>&1; tail -2 $OUT/check.out
cd /tmp && start=$SECONDS
BARQTRAIN_GIT_COMMIT=6d82aa8 timeout 400 python3 -m barqtrain.cli bench e2e --models llama-8b --compare hf --steps 10 --warmup 2 --out $OUT/e2e > $OUT/e2e.log 2>&1
echo "e2e rc $? in $((SECONDS - start)) s" >> $OUT/e2e.log
tail -10 $OUT/e2e.log
