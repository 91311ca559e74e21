#!/usr/bin/env bash
# Harness D: the working tree's Hopper kernels (persistent dQ), other objects as harness C.
set -e
CUT=/work/main/.venv/lib/python3.11/site-packages/cutlass_library/source/include
OUT=/work/main/.scratch/s11bin; OBJ=/tmp/s11obj
FLAGS=(-O3 -DNDEBUG --generate-code=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -std=c++17 -lineinfo)
HOP=(-DBARQTRAIN_HOPPER_KERNELS=1 -isystem $CUT)
A=/work/main/csrc/kernels/attention
cc() { nvcc -I/work/main/csrc "${FLAGS[@]}" "${HOP[@]}" -c "$@"; }
cc $A/hopper/forward_sm90.cu -o $OBJ/hf_d.o &
cc $A/hopper/backward_sm90.cu -o $OBJ/hb_d.o &
wait
L=(--generate-code=arch=compute_90a,code=sm_90a -lcuda)
nvcc $OBJ/h.o $OBJ/f.o $OBJ/b_c.o $OBJ/c_c.o $OBJ/r.o $OBJ/hb_d.o $OBJ/hf_d.o -o $OUT/harness_d "${L[@]}"
echo built
