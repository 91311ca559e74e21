"""Session 17, call 6: barqtrain-general and sdpa-flash at B4 S4096 H32/8 D128 causal through
`bench attn`'s own code: per-kernel times (torch.profiler) and the bench's timing, with the SM
clock and power logged by nvidia-smi while each runs."""
import os
import subprocess
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from barqtrain.bench.attention import AttentionCase, case_inputs, implementations, run_forward, run_forward_backward
from barqtrain.bench.timing import time_calls

out = os.environ["OUT"]
head_dim = int(sys.argv[1]) if len(sys.argv) > 1 else 128
case = AttentionCase(4, 4096, 32, 8, head_dim, True)
impls = implementations()
inputs = case_inputs(case, torch.device("cuda"))
for name in ["barqtrain-general", "sdpa-flash", "barqtrain-general"]:
    fn = impls[name]
    for _ in range(5):
        run_forward_backward(fn, case, inputs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            run_forward_backward(fn, case, inputs)
        torch.cuda.synchronize()
    print(f"== {name} {case.label}: kernels, us per step")
    for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
        if e.device_time_total > 0:
            print(f"{e.device_time_total / 10:10.1f}  {e.count / 10:4.1f}x  {e.key[:110]}")
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active",
                            "--format=csv,noheader", "-lms", "100"], stdout=open(f"{out}/smi_{name}_{head_dim}.txt", "a"))
    fb = time_calls(lambda i: run_forward_backward(fn, case, i), [inputs])
    fwd = time_calls(lambda i: run_forward(fn, case, i), [inputs])
    smi.terminate()
    print(f"{name}: forward {fwd.gpu_ms:.3f} ms, fwd+bwd {fb.gpu_ms:.3f} ms ({3.5 * case.forward_flops / fb.gpu_ms / 1e9:.1f} TFLOP/s), "
          f"backward {fb.gpu_ms - fwd.gpu_ms:.3f} ms")
