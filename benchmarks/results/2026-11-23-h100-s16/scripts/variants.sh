#!/usr/bin/env bash
# variants.sh OUTDIR NAME:FLAGS...: harness binaries of this tree's kernels, backward.cu per variant.
set -e
cd /work/main
OUTDIR=$1; shift
OBJ=/tmp/varobj; mkdir -p $OBJ
A=csrc/kernels/attention
FLAGS=(-Icsrc -O3 -DNDEBUG --generate-code=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -std=c++17 -lineinfo)
if [[ ! -f $OBJ/rotation.o || -n ${REBUILD_COMMON:-} ]]; then
  nvcc "${FLAGS[@]}" -c benchmarks/attention_harness/attention_harness.cu -o $OBJ/harness.o &
  nvcc "${FLAGS[@]}" -c $A/forward.cu -o $OBJ/forward.o &
  wait
  nvcc "${FLAGS[@]}" -c $A/checks.cu -o $OBJ/checks.o &
  nvcc "${FLAGS[@]}" -c $A/rotation.cu -o $OBJ/rotation.o &
  wait
fi
for spec in "$@"; do
  name=${spec%%:*}; flags=${spec#*:}
  nvcc "${FLAGS[@]}" $flags -c $A/backward.cu -o $OBJ/backward_$name.o
  nvcc --generate-code=arch=compute_90a,code=sm_90a $OBJ/harness.o $OBJ/forward.o $OBJ/checks.o $OBJ/rotation.o $OBJ/backward_$name.o -o $OUTDIR/$name -lcuda
  echo built $name
done
