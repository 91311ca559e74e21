#!/usr/bin/env bash
# Session 14, call 11 (an experiment, not landed): the sm_80 backward kernels with the shared-memory
# carveout held to an A100's 164 KB per SM (harness_g, branch exp/sm80-bwd-a100-carveout), so that
# one 105 KB CTA fits per SM as on an A100, against main's kernels (harness_f), harness --general,
# two rounds; ncu's occupancy of g's dK/dV kernel to confirm the limit took.
set -u
cd "$(dirname "$0")" && tar xJf bins11.tar.xz
REPO=$(cd ../.. && pwd)
HARNESS_ARGS=--general $REPO/benchmarks/attention_harness/compare.sh $OUT/harness.log 2 ./harness_f ./harness_g | grep -v " D256 "
timeout 60 ncu -k regex:'attention_dkdv_kernel' --launch-count 1 --section Occupancy --section LaunchStats ./harness_g --general > $OUT/ncu_g.txt 2>&1
grep -E "Block Limit Shared Mem|Theoretical Occupancy|Achieved Occupancy|Shared Memory Configuration Size" $OUT/ncu_g.txt
