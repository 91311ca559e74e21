#!/usr/bin/env bash
# Session 12 harness A/B: A = main (/tmp/wt_main), B = the working tree's hopper/backward_sm90.cu.
# Every other object comes from main. VARIANT names B's object and binary (default b).
set -e
V=${VARIANT:-b}; SRC=${SRC:-/work/main}
CUT=/work/main/.venv/lib/python3.11/site-packages/cutlass_library/source/include
H=/work/main/benchmarks/attention_harness
OUT=/work/main/.scratch/s12; OBJ=/tmp/s12obj; mkdir -p $OBJ
FLAGS=(-O3 -DNDEBUG --generate-code=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -std=c++17 -lineinfo)
HOP=(-DBARQTRAIN_HOPPER_KERNELS=1 -isystem $CUT)
M=/tmp/wt_main; A=$M/csrc/kernels/attention
cc() { nvcc -I$1/csrc "${FLAGS[@]}" "${@:3}" -c $2; }
if [[ ! -f $OBJ/hb_a.o ]]; then
cc $M $H/attention_harness.cu -o $OBJ/h.o &
cc $M $A/forward.cu "${HOP[@]}" -o $OBJ/f.o &
wait
cc $M $A/backward.cu "${HOP[@]}" -o $OBJ/b.o &
cc $M $A/checks.cu "${HOP[@]}" -o $OBJ/c.o &
wait
cc $M $A/rotation.cu "${HOP[@]}" -o $OBJ/r.o &
cc $M $A/hopper/forward_sm90.cu "${HOP[@]}" -o $OBJ/hf.o &
wait
cc $M $A/hopper/backward_sm90.cu "${HOP[@]}" -o $OBJ/hb_a.o
fi
cc $SRC $SRC/csrc/kernels/attention/hopper/backward_sm90.cu "${HOP[@]}" ${EXTRA} -Xptxas -v -o $OBJ/hb_$V.o 2> $OUT/ptxas_$V.log
L=(--generate-code=arch=compute_90a,code=sm_90a -lcuda)
[[ -f $OUT/harness_a ]] || nvcc $OBJ/h.o $OBJ/f.o $OBJ/b.o $OBJ/c.o $OBJ/r.o $OBJ/hf.o $OBJ/hb_a.o -o $OUT/harness_a "${L[@]}"
nvcc $OBJ/h.o $OBJ/f.o $OBJ/b.o $OBJ/c.o $OBJ/r.o $OBJ/hf.o $OBJ/hb_$V.o -o $OUT/harness_$V "${L[@]}"
echo built
