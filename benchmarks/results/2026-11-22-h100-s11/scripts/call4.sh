#!/usr/bin/env bash
# Session 11, call 4: the package built for sm_90a at main's head, the Python attention tests
# on the GPU (a skipped GPU test fails: BARQTRAIN_REQUIRE_GPU), then `bench attn`.
REPO=$(cd "$(dirname "$0")/../.." && pwd); cd "$REPO"
export BARQTRAIN_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/w .scratch/s11py/nvidia_cutlass-4.2.0.0-py3-none-any.whl
export PYTHONPATH=/tmp/w
start=$SECONDS
timeout 300 python3 -m pip install -q --no-build-isolation --no-deps --no-index \
  -Ccmake.define.BARQTRAIN_CUDA_ARCHITECTURES=90a -Ccmake.define.BARQTRAIN_ENABLE_HOPPER_KERNELS=ON . > $OUT/build.log 2>&1
echo "build rc $? in $((SECONDS - start)) s" | tee -a $OUT/build.log
cd /tmp && timeout 200 python3 -m pytest -q -p no:cacheprovider "$REPO/tests/python/ops/test_attention.py" "$REPO/tests/python/patch" -k "attention" > $OUT/pytest.log 2>&1
echo "pytest rc $?" >> $OUT/pytest.log
grep -E 'passed|failed|rror' $OUT/pytest.log | tail -8
true


