#!/usr/bin/env bash
# Session 17, call 1: per-kernel times of our general backward (harness, main 90367bb) and of
# SDPA-flash's backward at B4 S4096 H32/8, and the two main kernels' ncu sections side by side.
set -u
S=.scratch/s17
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.sm --format=csv | tee $OUT/gpu.txt
timeout 120 $S/main --general > $OUT/harness.log 2>&1; head -9 $OUT/harness.log
# Kernel durations without ncu's clock lock or cache flush; first case (D128 causal) only.
timeout 200 ncu --metrics gpu__time_duration.sum --cache-control none --clock-control none \
  -k regex:'attention_(kv_norms|dot|gradients|dq_from)' --launch-count 8 $S/main --general > $OUT/ncu_ours_times.txt 2>&1
grep -E "attention_|gpu__time" $OUT/ncu_ours_times.txt | head -40
timeout 200 python $S/flash_kernels.py > $OUT/flash_kernels.txt 2>&1; cat $OUT/flash_kernels.txt | head -60
# Sections of the two main kernels (D128 causal).
SEC="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section InstructionStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis"
timeout 150 ncu $SEC -k regex:attention_gradients --launch-count 1 $S/main --general > $OUT/ncu_ours_sections.txt 2>&1
cat > /tmp/flash1.py <<'PY'
import torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
q = torch.randn(4, 32, 4096, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k = torch.randn(4, 8, 4096, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
v = torch.randn(4, 8, 4096, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
    for _ in range(2):
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(torch.randn_like(q))
torch.cuda.synchronize()
PY
timeout 150 ncu $SEC -k regex:flash_bwd_dq_dk_dv --launch-count 1 python /tmp/flash1.py > $OUT/ncu_flash_sections.txt 2>&1
tail -5 $OUT/ncu_flash_sections.txt
