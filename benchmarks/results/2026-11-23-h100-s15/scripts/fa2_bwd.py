import torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
q, k, v = (torch.randn(4, 32, 4096, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
    for _ in range(3):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        o.backward(torch.ones_like(o))
torch.cuda.synchronize()
