#!/usr/bin/env bash
# build_general.sh TREE OUT_BINARY [nvcc flags]: attention_harness.cu against TREE's general kernels (sm_90a, no Hopper kernels).
set -e
HERE=$(cd "$(dirname "$0")" && pwd)
TREE=$1; BIN=$2; shift 2; OBJ=$(mktemp -d)
FLAGS=(-I"$TREE/csrc" -O3 -DNDEBUG --generate-code=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -std=c++17 -lineinfo "$@")
A=$TREE/csrc/kernels/attention
i=0
for src in "$HERE/attention_harness.cu" "$A/forward.cu" "$A/backward.cu" "$A/checks.cu" "$A/rotation.cu"; do
  nvcc "${FLAGS[@]}" -c "$src" -o "$OBJ/$i.o" & i=$((i + 1))
done
wait
nvcc --generate-code=arch=compute_90a,code=sm_90a "$OBJ"/*.o -o "$BIN" -lcuda
