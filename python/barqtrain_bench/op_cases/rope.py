"""Rotary position embedding of q and k in the per-op benchmark (fwd+bwd)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from barqtrain_bench.op_cases.base import EAGER, LIGER, OURS, OpBenchmark, OpCase, OpInputs, dtype_name

THETA = 500000.0  # Llama 3's


@dataclass(frozen=True)
class RopeShape:
    batch: int
    seq: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def label(self) -> str:
        heads = f"H{self.q_heads}/{self.kv_heads}"  # q heads / k heads
        return f"B{self.batch} {heads} S{self.seq} D{self.head_dim} {dtype_name(self.dtype)}"

    @property
    def q_and_k_bytes(self) -> int:
        return self.batch * self.seq * (self.q_heads + self.kv_heads) * self.head_dim * self.dtype.itemsize

    def heads_view(self, heads: int, device: torch.device) -> torch.Tensor:
        """[B, H, S, D] as HF's attention holds q and k: a transposed view of the [B, S, H, D] projection."""
        projection = torch.randn(self.batch, self.seq, heads, self.head_dim, device=device, dtype=self.dtype)
        return projection.transpose(1, 2).requires_grad_()


def _cos_sin(shape: RopeShape, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Real tables, [B, S, head_dim] in the activations' dtype, as LlamaRotaryEmbedding returns them."""
    from barqtrain.ops import RopeScaling, rope_cos_sin, rope_inv_freq

    inv_freq, attention_scaling = rope_inv_freq(RopeScaling(theta=THETA), shape.head_dim, device=device)
    positions = torch.arange(shape.seq, device=device).expand(shape.batch, shape.seq)
    return rope_cos_sin(inv_freq, positions, attention_scaling, shape.dtype)


def _rope_case(shape: RopeShape, device: torch.device) -> OpCase:
    cos, sin = _cos_sin(shape, device)

    def make_inputs() -> OpInputs:
        q, k = shape.heads_view(shape.q_heads, device), shape.heads_view(shape.kv_heads, device)
        # The gradients coming back from attention have q and k's layout (randn_like keeps strides).
        return OpInputs((q, k), (torch.randn_like(q), torch.randn_like(k)))

    def barqtrain():
        from barqtrain.ops import apply_rope

        return lambda q, k: apply_rope(q, k, cos, sin)

    def hf():
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        return lambda q, k: apply_rotary_pos_emb(q, k, cos, sin)

    def liger():
        from liger_kernel.ops.rope import LigerRopeFunction

        # Takes HF's [B, H, S, D] views as they are: it transposes them back to their
        # contiguous [B, S, H, D] storage and rotates there in place, no copy; its backward
        # rotates the incoming gradients in place too. Rotated inputs stay inputs.
        return lambda q, k: LigerRopeFunction.apply(q, k, cos, sin)

    return OpCase(
        label=shape.label,
        device=device,
        native_op="rope_forward",
        make_inputs=make_inputs,
        # cos and sin (read once per token, shared by the heads) are under 3% of it and left out.
        forward_bytes=2 * shape.q_and_k_bytes,  # read q and k, write q_out and k_out
        backward_bytes=2 * shape.q_and_k_bytes,  # read dq_out and dk_out, write dq and dk
        builders={OURS: barqtrain, EAGER: hf, LIGER: liger},
    )


ROPE = OpBenchmark(
    op="rope",
    shapes=(RopeShape(batch=4, seq=4096, q_heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16),),
    smoke_shape=RopeShape(batch=2, seq=7, q_heads=4, kv_heads=2, head_dim=64, dtype=torch.bfloat16),
    make_case=_rope_case,
)
