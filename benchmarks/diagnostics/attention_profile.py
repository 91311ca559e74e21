"""Where the attention time goes (issues 5 and 6), one implementation after another.

One forward + backward (or forward only) of each implementation asked for, `barqtrain bench
attn`'s own (barqtrain_bench.attention), at the issues' case (B4 S4096 H32/8 D128 causal, bf16
by default), each after warm-up, inside a profiler range so that Nsight Compute sees only those
launches:

  ncu --profile-from-start off --section SpeedOfLight --section ComputeWorkloadAnalysis \\
      --section WarpStateStats --section Occupancy --section LaunchStats \\
      python benchmarks/diagnostics/attention_profile.py [--impl barqtrain-general sdpa-flash --forward-only]

Without ncu it prints each one's CUDA-event time, so the profiled run can be checked against an
unprofiled one.
"""

import argparse

import torch

from barqtrain_bench.attention import AttentionCase, case_inputs, implementations, run_forward, run_forward_backward
from barqtrain_bench.environment import Unavailable


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--full", action="store_true", help="no causal mask")
    parser.add_argument("--impl", nargs="+", default=["barqtrain-hopper", "sdpa-cudnn"],
                        help="names from `barqtrain bench attn` (barqtrain-general, barqtrain-hopper, ...)")
    parser.add_argument("--forward-only", action="store_true", help="profile the forward alone")
    args = parser.parse_args()
    available = implementations()
    unknown = sorted(set(args.impl) - set(available))
    if unknown:
        parser.error(f"unknown --impl {', '.join(unknown)}; choose from {', '.join(available)}")

    case = AttentionCase(args.batch, args.seq, args.q_heads, args.kv_heads, args.head_dim, causal=not args.full)
    inputs = case_inputs(case, torch.device("cuda"))
    run, what, multiple = (
        (run_forward, "forward", 1.0) if args.forward_only else (run_forward_backward, "forward+backward", 3.5)
    )
    for name in args.impl:
        fn = available[name]
        if isinstance(fn, Unavailable):
            print(f"{name}: unavailable ({fn.reason})", flush=True)
            continue
        for _ in range(3):
            run(fn, case, inputs)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        start.record()
        run(fn, case, inputs)
        end.record()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        ms = start.elapsed_time(end)
        print(f"{name}: {what} {ms:.2f} ms, {multiple * case.forward_flops / (ms * 1e-3) / 1e12:.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
