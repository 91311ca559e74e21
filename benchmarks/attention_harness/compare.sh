#!/usr/bin/env bash
# compare.sh LOG ROUNDS BINARY...: on the GPU machine, runs harness binaries (build.sh) ROUNDS
# times, interleaved (a b a b ...) so that a drifting clock hits them alike, appends their
# output to LOG and prints one line per binary, round and case: forward TFLOP/s, backward ms,
# forward+backward TFLOP/s and the hash of every output (equal hashes: bit-identical results).
# HARNESS_ARGS go to every binary (--general: the sm_80 kernels).
set -u
LOG=$1; ROUNDS=$2; shift 2
for round in $(seq "$ROUNDS"); do
  for bin in "$@"; do
    echo "== $(basename "$bin") round $round" >>"$LOG"
    timeout 100 "$bin" ${HARNESS_ARGS:-} >>"$LOG" 2>&1
  done
done
grep -E "==|causal|full" "$LOG" |
  awk '/==/{b = $2 " " $4} !/==/{print b, $1, $2, $3, $4, $5, "fwd", $9, "bwd", $13, "fb", $18, $NF}'
