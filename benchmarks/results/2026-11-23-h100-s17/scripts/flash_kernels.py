"""Session 17: SDPA-flash's backward kernels at B4 S4096 H32/8 D128 causal, by torch.profiler."""
import sys
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import profile, ProfilerActivity

cases = [(4, 4096, 32, 8, 128, True), (4, 4096, 32, 8, 64, True), (4, 4096, 32, 8, 128, False)]
for b, s, h, hk, d, causal in cases:
    q = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, hk, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, hk, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    d_o = torch.randn_like(q)
    def step():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True).backward(d_o)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            step()
        torch.cuda.synchronize()
    print(f"== B{b} S{s} H{h}/{hk} D{d} {'causal' if causal else 'full'} (10 steps, us per step)")
    for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
        if e.device_time_total > 0:
            print(f"{e.device_time_total / 10:10.1f}  {e.count / 10:4.1f}x  {e.key[:150]}")
