"""Where the attention time goes (issue 6): one forward + backward of BarqTrain's attention op
(on sm_90 the Hopper kernels) and one of cuDNN's through SDPA, at the issue's case (B4 S4096
H32/8 D128 causal, bf16), each after warm-up, inside a profiler range so that Nsight Compute
sees only those launches:

  ncu --profile-from-start off --section SpeedOfLight --section ComputeWorkloadAnalysis \\
      --section WarpStateStats --section Occupancy --section LaunchStats \\
      python scripts/diagnostics/attention_profile.py

Without ncu it prints each implementation's CUDA-event time, so the profiled run can be checked
against an unprofiled one.
"""

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import barqtrain.ops  # noqa: F401  (registers torch.ops.barqtrain)


def barqtrain_attention(q, k, v):
    o, _ = torch.ops.barqtrain.attention_forward(q, k, v, None, None, q.shape[1], k.shape[1], q.shape[-1] ** -0.5,
                                                 0.0, True, -1, -1, None, None, None)
    return o


def cudnn_attention(q, k, v):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           enable_gqa=True)
    return o.transpose(1, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()

    def make(heads):
        return torch.randn(args.batch, args.seq, heads, args.head_dim, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True)

    q, k, v = make(args.q_heads), make(args.kv_heads), make(args.kv_heads)
    d_o = torch.randn_like(q)
    flops = 4.0 * args.batch * args.q_heads * args.seq * args.seq * args.head_dim / 2  # causal forward
    for name, fn in (("barqtrain", barqtrain_attention), ("cudnn", cudnn_attention)):
        def step():
            torch.autograd.grad(fn(q, k, v), (q, k, v), d_o)

        for _ in range(3):
            step()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        ms = start.elapsed_time(end)
        print(f"{name}: forward+backward {ms:.2f} ms, {3.5 * flops / (ms * 1e-3) / 1e12:.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
