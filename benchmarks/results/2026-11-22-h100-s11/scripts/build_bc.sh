#!/usr/bin/env bash
# Harness B (persistent forward, main's backward) and C (persistent forward + the dQ kernel
# computing D) from the working tree (s11-combined); shared objects from build_harnesses.sh.
set -e
CUT=/work/main/.venv/lib/python3.11/site-packages/cutlass_library/source/include
OUT=/work/main/.scratch/s11; OBJ=/tmp/s11obj
FLAGS=(-O3 -DNDEBUG --generate-code=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -std=c++17 -lineinfo)
HOP=(-DBARQTRAIN_HOPPER_KERNELS=1 -isystem $CUT)
A=/work/main/csrc/kernels/attention
cc() { nvcc -I/work/main/csrc "${FLAGS[@]}" "${HOP[@]}" -c "$@"; }
cc $A/hopper/forward_sm90.cu -o $OBJ/hf_b.o &
cc $A/backward.cu -o $OBJ/b_c.o &
wait
cc $A/hopper/backward_sm90.cu -o $OBJ/hb_c.o &
cc $A/checks.cu -o $OBJ/c_c.o &
wait
L=(--generate-code=arch=compute_90a,code=sm_90a -lcuda)
nvcc $OBJ/h.o $OBJ/f.o $OBJ/b.o $OBJ/c.o $OBJ/r.o $OBJ/hb.o $OBJ/hf_b.o -o $OUT/harness_b "${L[@]}"
nvcc $OBJ/h.o $OBJ/f.o $OBJ/b_c.o $OBJ/c_c.o $OBJ/r.o $OBJ/hb_c.o $OBJ/hf_b.o -o $OUT/harness_c "${L[@]}"
echo built
