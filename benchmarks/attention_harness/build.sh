#!/usr/bin/env bash
# build.sh TREE OUT_BINARY [CUTLASS_INCLUDE]: attention_harness.cu against TREE's attention
# kernels, for sm_90a, here (nvcc, no GPU needed), so that the device's minutes go to running
# them. With CUTLASS_INCLUDE the Hopper kernels are built in; without, the general kernels
# alone (run those with --general). JOBS nvcc at a time. compare.sh runs the binaries side by
# side on the GPU machine; scripts/kernel_tests_sharded.sh runs a carried kernel test binary.
set -e
HERE=$(cd "$(dirname "$0")" && pwd)
TREE=$1; BIN=$2; CUTLASS_INCLUDE=${3:-}; OBJ=$(mktemp -d)
A=$TREE/csrc/kernels/attention
FLAGS=(-I"$TREE/csrc" -O3 -DNDEBUG --generate-code=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr
       -std=c++17 -lineinfo)
SOURCES=("$HERE/attention_harness.cu" "$A/forward.cu" "$A/backward.cu" "$A/checks.cu" "$A/rotation.cu")
if [[ -n $CUTLASS_INCLUDE ]]; then
  FLAGS+=(-DBARQTRAIN_HOPPER_KERNELS=1 -isystem "$CUTLASS_INCLUDE")
  SOURCES+=("$A/hopper/forward_sm90.cu" "$A/hopper/backward_sm90.cu")
fi
i=0
for src in "${SOURCES[@]}"; do
  nvcc "${FLAGS[@]}" -c "$src" -o "$OBJ/$i.o" &
  i=$((i + 1))
  if (( i % ${JOBS:-2} == 0 )); then wait; fi
done
wait
nvcc --generate-code=arch=compute_90a,code=sm_90a "$OBJ"/*.o -o "$BIN" -lcuda
