#!/usr/bin/env bash
# Session 16, call 3 (572c3d9's tree): kernel tests and sanitizers of the fixed-point square-tile
# backward; the harness against main (d567a1c's kernels) and against the same tree compiled to
# compute_80 PTX only (the seven-product path, JIT on the H100); SDPA flash/cuDNN on the same cases.
set -u
S=.scratch/s16
tar xJf $S/bins3.tar.xz -C $S
nvidia-smi --query-gpu=name,clocks.max.sm,driver_version --format=csv > $OUT/gpu.txt
SANITIZE_TIMEOUT=300 SANITIZE_FILTER="AllShapes/AttentionKernel.*packed_many_short:AllShapes/AttentionKernel.*bf16_s1000_causal_gqa8:AllShapes/AttentionKernel.*bf16_cross_lengths_causal:AllShapes/AttentionKernel.*bf16_packed_rope_positions:AllShapes/AttentionKernel.*fp16_softcap50_window:AllShapes/AttentionKernel.*bf16_d96_causal_gqa4:AllShapes/AttentionKernel.*bf16_d64_full_s17" \
  bash scripts/kernel_tests_sharded.sh $S/barqtrain_kernel_tests "AllShapes/*:AttentionArguments.*:AttentionDispatch.*" $OUT/tests > $OUT/tests_summary.txt 2>&1
cat $OUT/tests_summary.txt
HARNESS_ARGS=--general bash benchmarks/attention_harness/compare.sh $OUT/compare.log 2 $S/harness_main $S/h_fp $S/h_fp_ptx80 $S/h_stm > $OUT/compare.txt
cat $OUT/compare.txt
timeout 200 python benchmarks/attention_harness/sdpa_ref.py > $OUT/sdpa.txt 2>&1
cat $OUT/sdpa.txt
