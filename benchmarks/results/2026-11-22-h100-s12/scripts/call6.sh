#!/usr/bin/env bash
# Session 12, call 6: main (pipelined backward) built for sm_90a; Nsight Compute on one forward +
# backward of the Hopper kernels and of cuDNN (B4 S4096 H32/8 D128 causal); then the end-to-end
# LoRA benchmark on the Llama-3.2-1B shape against Hugging Face + PEFT.
REPO=$(cd "$(dirname "$0")/../.." && pwd); cd "$REPO"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/w .scratch/s12py/nvidia_cutlass-4.2.0.0-py3-none-any.whl
export PYTHONPATH=/tmp/w
start=$SECONDS
timeout 300 python3 -m pip install -q --no-build-isolation --no-deps --no-index \
  -Ccmake.define.BARQTRAIN_CUDA_ARCHITECTURES=90a -Ccmake.define.BARQTRAIN_ENABLE_HOPPER_KERNELS=ON . > $OUT/build.log 2>&1
echo "build rc $? in $((SECONDS - start)) s" | tee -a $OUT/build.log
cd /tmp
timeout 150 ncu --profile-from-start off --section SpeedOfLight --section ComputeWorkloadAnalysis \
  --section WarpStateStats --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
  python3 "$REPO/scripts/diagnostics/attention_profile.py" --impl barqtrain-hopper sdpa-cudnn > $OUT/ncu.txt 2>&1
echo "ncu rc $?" >> $OUT/ncu.txt
grep -E '^  [a-z_].*\(|Duration|Compute \(SM\) Throughput|DRAM Throughput|L2 Cache Throughput|Executed Ipc A|Issue Slots Busy|Tensor|Stall|forward' $OUT/ncu.txt | head -80
start=$SECONDS
timeout 330 python3 -m barqtrain.cli bench e2e --models llama-1b --compare hf --steps 10 --warmup 2 --out $OUT/e2e > $OUT/e2e.log 2>&1
echo "e2e rc $? in $((SECONDS - start)) s" >> $OUT/e2e.log
tail -25 $OUT/e2e.log
