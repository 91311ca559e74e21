"""Where the attention time goes (issues 5 and 6), one implementation after another.

One forward + backward (or forward only) of each implementation asked for, at the issues'
case (B4 S4096 H32/8 D128 causal, bf16), each after warm-up, inside a profiler range so that
Nsight Compute sees only those launches:

  ncu --profile-from-start off --section SpeedOfLight --section ComputeWorkloadAnalysis \\
      --section WarpStateStats --section Occupancy --section LaunchStats \\
      python scripts/diagnostics/attention_profile.py [--impl barqtrain-general flash --forward-only]

Implementations: barqtrain (kAuto: the Hopper kernels on sm_90), barqtrain-general (the sm_80
forward; the backward stays kAuto's), cudnn and flash (SDPA's backends). Without ncu it prints
each one's CUDA-event time, so the profiled run can be checked against an unprofiled one.
"""

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import barqtrain.ops  # noqa: F401  (registers torch.ops.barqtrain)


def barqtrain_attention(forward_kernel):
    def run(q, k, v):
        o, _ = torch.ops.barqtrain.attention_forward(q, k, v, None, None, q.shape[1], k.shape[1], q.shape[-1] ** -0.5,
                                                     0.0, True, -1, -1, None, None, None, forward_kernel=forward_kernel)
        return o

    return run


def sdpa_attention(backend):
    def run(q, k, v):
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                               enable_gqa=True)
        return o.transpose(1, 2)

    return run


IMPLEMENTATIONS = {
    "barqtrain": barqtrain_attention("auto"),
    "barqtrain-general": barqtrain_attention("general"),
    "cudnn": sdpa_attention(SDPBackend.CUDNN_ATTENTION),
    "flash": sdpa_attention(SDPBackend.FLASH_ATTENTION),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--impl", nargs="+", choices=sorted(IMPLEMENTATIONS), default=["barqtrain", "cudnn"])
    parser.add_argument("--forward-only", action="store_true", help="profile the forward alone")
    args = parser.parse_args()

    def make(heads):
        return torch.randn(args.batch, args.seq, heads, args.head_dim, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True)

    q, k, v = make(args.q_heads), make(args.kv_heads), make(args.kv_heads)
    d_o = torch.randn_like(q)
    flops = 4.0 * args.batch * args.q_heads * args.seq * args.seq * args.head_dim / 2  # causal forward
    what, multiple = ("forward", 1.0) if args.forward_only else ("forward+backward", 3.5)
    for name in args.impl:
        fn = IMPLEMENTATIONS[name]

        def step():
            if args.forward_only:
                with torch.no_grad():
                    fn(q, k, v)
            else:
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
        print(f"{name}: {what} {ms:.2f} ms, {multiple * flops / (ms * 1e-3) / 1e12:.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
