#!/usr/bin/env bash
# Session 12, call 7: main (pipelined backward) built for sm_90a; the end-to-end LoRA benchmark on
# the Llama-3.1-8B shape against Hugging Face + PEFT.
REPO=$(cd "$(dirname "$0")/../.." && pwd); cd "$REPO"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/w .scratch/s12py/nvidia_cutlass-4.2.0.0-py3-none-any.whl
export PYTHONPATH=/tmp/w
start=$SECONDS
timeout 300 python3 -m pip install -q --no-build-isolation --no-deps --no-index \
  -Ccmake.define.BARQTRAIN_CUDA_ARCHITECTURES=90a -Ccmake.define.BARQTRAIN_ENABLE_HOPPER_KERNELS=ON . > $OUT/build.log 2>&1
echo "build rc $? in $((SECONDS - start)) s" | tee -a $OUT/build.log
cd /tmp
start=$SECONDS
timeout 480 python3 -m barqtrain.cli bench e2e --models llama-8b --compare hf --steps 10 --warmup 2 --out $OUT/e2e > $OUT/e2e.log 2>&1
echo "e2e rc $? in $((SECONDS - start)) s" >> $OUT/e2e.log
tail -25 $OUT/e2e.log
