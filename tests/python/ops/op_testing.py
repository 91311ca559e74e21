"""Shared checks of the op tests: error norms and allocator poisoning."""

from __future__ import annotations

import torch


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; inf when out holds NaN/inf (an unwritten element)."""
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(out64).all():
        return float("inf")
    return ((out64 - ref64).norm() / ref64.norm().clamp_min(1e-300)).item()


def poison_cuda_allocator(*like: torch.Tensor) -> None:
    """Fill freshly freed blocks of the shapes an op is about to allocate with NaN.

    The caching allocator hands the most recently freed block of a size class to the next
    allocation of that size, so an output element the kernel never writes reads as NaN.
    """
    blocks = [torch.full_like(t, float("nan")) for t in like]
    torch.cuda.synchronize()
    del blocks


# PyTorch's own error in the same dtype sets the bar; two computations of equal precision
# differ by rounding noise, hence the slack factor.
NOISE_FACTOR = 1.25


# An exactly zero reference (attention's dQ and dK with one visible key: dS = P (dP - D) = 0)
# has no relative scale: both computations leave the fp32 rounding of dP - D there. Their
# root-mean-square is bounded instead, at a few fp32 ulps of the unit-scale inputs.
ZERO_REFERENCE_RMS = 4 * torch.finfo(torch.float32).eps


def assert_no_worse_than_torch(name: str, ours: torch.Tensor, torch_same_dtype: torch.Tensor, ref: torch.Tensor,
                               floor: float = 1e-6) -> None:
    if not ref.any():
        ours_rms = ours.detach().double().pow(2).mean().sqrt().item()
        assert ours_rms <= ZERO_REFERENCE_RMS, (
            f"{name}: root-mean-square {ours_rms:.3e} where the exact result is zero (bound {ZERO_REFERENCE_RMS:.3e})"
        )
        return
    ours_err = relative_error(ours, ref)
    torch_err = relative_error(torch_same_dtype, ref)
    assert ours_err <= max(NOISE_FACTOR * torch_err, floor), (
        f"{name}: relative error {ours_err:.3e} vs PyTorch's {torch_err:.3e} in the same dtype"
    )
