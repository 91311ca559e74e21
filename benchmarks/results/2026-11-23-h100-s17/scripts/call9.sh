#!/usr/bin/env bash
# Session 17, call 9: main at the session's last kernel change (f1dc59c): kernel tests (tile
# order included), the package built on the device, the Python GPU attention tests, bench attn.
set -u
S=.scratch/s17
tar -xJf $S/v9.tar.xz -C $S
bash scripts/kernel_tests_sharded.sh $S/v9/barqtrain_kernel_tests "AllShapes/*:AttentionArguments.*:AttentionDispatch.*:KeyTileOrder*" $OUT/tests > $OUT/tests_summary.txt 2>&1
cat $OUT/tests_summary.txt
BARQTRAIN_GIT_COMMIT=$(cat $S/commit) CUDA_ARCHS=90a PHASES="build python bench-attn" \
  PYTEST_ARGS="-m gpu -k attention" timeout 480 bash scripts/gpu_check.sh $OUT/check > $OUT/check.out 2>&1
tail -5 $OUT/check.out
