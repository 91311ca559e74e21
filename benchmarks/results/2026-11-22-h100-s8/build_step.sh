#!/usr/bin/env bash
# build_step.sh TREE CUTLASS_INCLUDE OUT_BINARY: attention_harness.cu against TREE's
# attention kernels (sm_90a, the Hopper kernels built in).
set -e
HERE=$(cd "$(dirname "$0")" && pwd)
TREE=$1; INC=$2; BIN=$3; OBJ=$(mktemp -d)
FLAGS=(-DBARQTRAIN_HOPPER_KERNELS=1 -I"$TREE/csrc" -isystem "$INC" -O3 -DNDEBUG
       --generate-code=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -std=c++17)
A=$TREE/csrc/kernels/attention
SOURCES=("$HERE/attention_harness.cu" "$A/forward.cu" "$A/backward.cu" "$A/checks.cu" "$A/rotation.cu"
         "$A/hopper/forward_sm90.cu" "$A/hopper/backward_sm90.cu")
i=0
for src in "${SOURCES[@]}"; do
  nvcc "${FLAGS[@]}" -c "$src" -o "$OBJ/$i.o" &
  i=$((i + 1))
  if (( i % ${JOBS:-2} == 0 )); then wait; fi
done
wait
nvcc --generate-code=arch=compute_90a,code=sm_90a "$OBJ"/*.o -o "$BIN" -lcuda
