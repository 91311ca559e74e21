#!/usr/bin/env bash
# Session 16, call 2: variants of the square-tile backward (D64 with 128-query steps; dS K
# before dK), then ncu on the square-tile kernel at B4 S4096 H32/8 D128 causal.
set -u
S=.scratch/s16
tar xJf $S/bins2.tar.xz -C $S
HARNESS_ARGS=--general bash benchmarks/attention_harness/compare.sh $OUT/compare.log 2 $S/h_square $S/h_d64m128 $S/h_dqfirst > $OUT/compare.txt
cat $OUT/compare.txt
timeout 200 ncu --kernel-name regex:attention_gradients_kernel --launch-count 1 --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section InstructionStats --section Occupancy --section SchedulerStats $S/h_square --general > $OUT/ncu_square.txt 2>&1
grep -E "Duration|Throughput|Stall|Issued|Warp Cycles|Eligible|Active Warps|Registers|Shared" $OUT/ncu_square.txt | head -60
