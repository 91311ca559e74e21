"""Which baseline: dq/dk/dv relative errors against float64 for the separate-cu_seqlens case,
ours (the op) against SDPA per sequence with its backends, and the same with q_len == k_len."""
import sys
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
sys.path.insert(0, sys.argv[1] + "/tests/python/ops")
import importlib
attention_impl = importlib.import_module("barqtrain.ops.attention")
from barqtrain.ops.attention import attention
from test_attention import _float64_reference, packed_qkv
from op_testing import relative_error

def run(q_lens, k_lens, causal, head_dim, label):
    torch.manual_seed(0)
    q, _, _, cu_q = packed_qkv(q_lens, 8, 2, head_dim, torch.bfloat16, "cuda")
    _, k, v, cu_k = packed_qkv(k_lens, 8, 2, head_dim, torch.bfloat16, "cuda")
    d_o = torch.randn_like(q)
    scale = head_dim ** -0.5
    ref = _float64_reference(q, k, v, d_o, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, softmax_scale=scale, causal=causal)
    results = {}
    out = attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=causal, softmax_scale=scale)
    results["ours"] = (out, *torch.autograd.grad(out, (q, k, v), d_o))
    for name, backend in (("sdpa-efficient", SDPBackend.EFFICIENT_ATTENTION), ("sdpa-math", SDPBackend.MATH),
                          ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                o = attention_impl._fallback(q, k, v, cu_q, cu_k, scale, 0.0, causal, -1, -1, None, None, None)
                results[name] = (o, *torch.autograd.grad(o, (q, k, v), d_o))
        except RuntimeError as error:
            print(label, name, "not run:", str(error).splitlines()[0])
    for name, grads in results.items():
        errs = " ".join(f"{n} {relative_error(g, r):.3e}" for n, g, r in zip(("o", "dq", "dk", "dv"), grads, ref))
        print(f"{label:28s} {name:15s} {errs}", flush=True)

run([3, 130, 77, 150, 300], [5, 260, 77, 151, 700], True, 128, "separate causal d128")
run([3, 130, 77, 150, 300], [3, 130, 77, 150, 300], True, 128, "shared-lengths causal d128")
run([3, 130, 77, 150, 300], [5, 260, 77, 151, 700], False, 64, "separate full d64")
run([300, 300, 300], [700, 700, 700], True, 128, "separate 300x700 causal")
