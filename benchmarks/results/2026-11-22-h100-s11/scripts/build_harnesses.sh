#!/usr/bin/env bash
# Session 11 harness A/B: A = main (/tmp/wt_main), B = the working tree's forward_sm90.cu.
# Every other object comes from main.
set -e
CUT=/work/main/.venv/lib/python3.11/site-packages/cutlass_library/source/include
H=/work/main/benchmarks/attention_harness
OUT=/work/main/.scratch/s11; OBJ=/tmp/s11obj; mkdir -p $OBJ
FLAGS=(-O3 -DNDEBUG --generate-code=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -std=c++17 -lineinfo)
HOP=(-DBARQTRAIN_HOPPER_KERNELS=1 -isystem $CUT)
M=/tmp/wt_main; A=$M/csrc/kernels/attention
cc() { nvcc -I$1/csrc "${FLAGS[@]}" "${@:3}" -c $2; }
if [[ ! -f $OBJ/hb.o ]]; then
cc $M $H/attention_harness.cu -o $OBJ/h.o &
cc $M $A/forward.cu "${HOP[@]}" -o $OBJ/f.o &
wait
cc $M $A/backward.cu "${HOP[@]}" -o $OBJ/b.o &
cc $M $A/checks.cu "${HOP[@]}" -o $OBJ/c.o &
wait
cc $M $A/rotation.cu "${HOP[@]}" -o $OBJ/r.o &
cc $M $A/hopper/backward_sm90.cu "${HOP[@]}" -o $OBJ/hb.o &
wait
cc $M $A/hopper/forward_sm90.cu "${HOP[@]}" -o $OBJ/hf_a.o
fi
cc /work/main /work/main/csrc/kernels/attention/hopper/forward_sm90.cu "${HOP[@]}" -o $OBJ/hf_b.o
L=(--generate-code=arch=compute_90a,code=sm_90a -lcuda)
nvcc $OBJ/h.o $OBJ/f.o $OBJ/b.o $OBJ/c.o $OBJ/r.o $OBJ/hb.o $OBJ/hf_a.o -o $OUT/harness_a "${L[@]}"
nvcc $OBJ/h.o $OBJ/f.o $OBJ/b.o $OBJ/c.o $OBJ/r.o $OBJ/hb.o $OBJ/hf_b.o -o $OUT/harness_b "${L[@]}"
echo built
