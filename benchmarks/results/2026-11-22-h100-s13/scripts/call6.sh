#!/usr/bin/env bash
# Session 13, call 6: main at b7542fe: the package, bench attn (a second run beside call 5's),
# and the end-to-end LoRA step on the Llama-3.2-1B shape with and without the attention op.
REPO=$(cd "$(dirname "$0")/../.." && pwd)
cd $REPO && BARQTRAIN_GIT_COMMIT=b7542fe CUDA_ARCHS=90a PHASES="build bench-attn" timeout 330 bash scripts/gpu_check.sh $OUT/check > $OUT/check.out 2>&1; tail -3 $OUT/check.out
cd /tmp && start=$SECONDS
BARQTRAIN_GIT_COMMIT=b7542fe timeout 200 python3 -m barqtrain.cli bench e2e --models llama-1b --compare hf --steps 10 --warmup 2 --out $OUT/e2e > $OUT/e2e.log 2>&1
echo "e2e rc $? in $((SECONDS - start)) s" >> $OUT/e2e.log
tail -12 $OUT/e2e.log
