#!/usr/bin/env bash
# Session 12, call 5: main at the pipelined backward. The sanitizers on the backward cases call 4's
# ran out of time on (in the background, on the test binary built from main), the package built
# for sm_90a, the Python attention tests on the GPU (BARQTRAIN_REQUIRE_GPU), then `bench attn` alone.
REPO=$(cd "$(dirname "$0")/../.." && pwd); cd "$REPO/.scratch/s12" && tar xJf bins5.tar.xz
SAN='HopperBackward/*many_tiles*:HopperBackward/*_s1-*d128_causal_s384*'
for tool in memcheck racecheck synccheck; do
  (timeout 420 compute-sanitizer --tool $tool --error-exitcode 1 ./barqtrain_kernel_tests --gtest_filter="$SAN" > $OUT/$tool.log 2>&1;
   echo "$tool rc $?" >> $OUT/$tool.log) &
done
cd "$REPO"
export BARQTRAIN_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/w .scratch/s12py/nvidia_cutlass-4.2.0.0-py3-none-any.whl
export PYTHONPATH=/tmp/w
start=$SECONDS
timeout 300 python3 -m pip install -q --no-build-isolation --no-deps --no-index \
  -Ccmake.define.BARQTRAIN_CUDA_ARCHITECTURES=90a -Ccmake.define.BARQTRAIN_ENABLE_HOPPER_KERNELS=ON . > $OUT/build.log 2>&1
echo "build rc $? in $((SECONDS - start)) s" | tee -a $OUT/build.log
cd /tmp && timeout 200 python3 -m pytest -q -p no:cacheprovider "$REPO/tests/python/ops/test_attention.py" "$REPO/tests/python/patch" -k "attention" > $OUT/pytest.log 2>&1
echo "pytest rc $?" >> $OUT/pytest.log
grep -E 'passed|failed|rror' $OUT/pytest.log | tail -8
wait
for tool in memcheck racecheck synccheck; do grep -E "OK \]" $OUT/$tool.log | wc -l; tail -2 $OUT/$tool.log; done
timeout 240 python3 -m barqtrain.cli bench attn --out $OUT/attn > $OUT/bench_attn.log 2>&1
echo "bench rc $?" >> $OUT/bench_attn.log
grep -E "^(B4 S4096 H32/32 D128 causal|B4 S4096 H32/8 D128 causal|B1 S16384 H32/8 D128 causal|B4 S4096 H32/8 D128 full|B4 S4096 H32/8 D64 causal) " $OUT/bench_attn.log
tail -1 $OUT/bench_attn.log
