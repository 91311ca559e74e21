"""SDPA's flash and cuDNN backends on attention_harness.cu's cases, forward and forward+backward,
timed with events; flash also under torch.use_deterministic_algorithms (sdpa-flash-det, which
FlashAttention-2 serves with its deterministic backward). Each row says whether two backwards
gave bit-identical dQ ("dQ repeats").

With an argument: three forwards of the first case per backend only (for ncu).
"""

import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

CASES = [  # batch, seq, q heads, kv heads, head_dim, causal
    (4, 4096, 32, 32, 128, True),
    (4, 4096, 32, 8, 128, True),
    (4, 4096, 32, 8, 128, False),
    (4, 4096, 32, 8, 64, True),
    (1, 16384, 32, 8, 128, True),
    (4, 4096, 32, 8, 64, False),
    (2, 4096, 16, 8, 256, True),
    (2, 4096, 16, 8, 256, False),
    (4, 4096, 32, 8, 96, True),
    (4, 4096, 32, 8, 96, False),
]
BACKENDS = (  # name, backend, deterministic
    ("sdpa-flash", SDPBackend.FLASH_ATTENTION, False),
    ("sdpa-flash-det", SDPBackend.FLASH_ATTENTION, True),
    ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION, False),
)


def best_ms(fn, trials: int = 3, reps: int = 10) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(trials):
        start, end = (
            torch.cuda.Event(enable_timing=True),
            torch.cuda.Event(enable_timing=True),
        )
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / reps)
    return best


def run_case(
    batch: int,
    seq: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    causal: bool,
    profile_only: bool,
) -> None:
    def operand(head_count: int) -> torch.Tensor:
        shape = (batch, head_count, seq, head_dim)
        return torch.randn(
            shape, device="cuda", dtype=torch.bfloat16, requires_grad=True
        )

    q, k, v = operand(heads), operand(kv_heads), operand(kv_heads)
    d_o = torch.randn_like(q)
    flops = 4 * batch * heads * seq * seq * head_dim * (0.5 if causal else 1.0)

    def forward():
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, enable_gqa=True
        )

    def forward_backward():
        forward().backward(d_o)

    label = f"B{batch} S{seq} H{heads}/{kv_heads} D{head_dim} {'causal' if causal else 'full':6s}"
    def dq_repeats() -> bool:
        grads = []
        for _ in range(2):
            q.grad = None
            forward_backward()
            grads.append(q.grad.clone())
        return torch.equal(*grads)

    for name, backend, deterministic in BACKENDS:
        torch.use_deterministic_algorithms(deterministic)
        with sdpa_kernel(backend):
            if profile_only:
                for _ in range(3):
                    forward()
                torch.cuda.synchronize()
                continue
            try:
                fwd_ms = best_ms(forward)
            except (
                RuntimeError
            ) as error:  # a backend without this shape says so, once per line
                print(
                    f"{name:14s} {label} not run: {str(error).splitlines()[0]}",
                    flush=True,
                )
                continue
            try:
                both = f"fwd+bwd {3.5 * flops / best_ms(forward_backward) / 1e9:5.1f}"
                both += f" | dQ repeats {'yes' if dq_repeats() else 'no'}"
            except RuntimeError as error:
                both = f"backward not run: {str(error).splitlines()[0]}"
        print(
            f"{name:14s} {label} forward {fwd_ms:.3f} ms {flops / fwd_ms / 1e9:5.1f} TFLOP/s | {both}",
            flush=True,
        )


def main() -> None:
    profile_only = len(sys.argv) > 1
    for case in CASES[:1] if profile_only else CASES:
        run_case(*case, profile_only)


if __name__ == "__main__":
    main()
