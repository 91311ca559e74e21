#!/usr/bin/env bash
# Session 14, call 10: the LayerNorm GPU test with dx's floor from the cancelling terms (call 9
# failed it once at hidden 3: 3.2e-6 against a fixed 2e-6 floor), five runs on fresh inputs.
REPO=$(cd "$(dirname "$0")/../.." && pwd)
cd $REPO && BARQTRAIN_GIT_COMMIT=work CUDA_ARCHS=90a PHASES="build" timeout 200 bash scripts/gpu_check.sh $OUT/check > $OUT/check.out 2>&1
tail -2 $OUT/check.out
cd /tmp && for i in 1 2 3 4 5; do BARQTRAIN_REQUIRE_GPU=1 python3 -m pytest -q -p no:cacheprovider $REPO/tests/python/ops/test_norm.py -k "layer_norm" -m gpu 2>&1 | tail -1; done
