"""The end-to-end benchmark's workloads: real model shapes embedded in code (no network).

Weights are random: throughput and memory depend on the shapes alone, and a fixed seed
makes every variant start from the same weights. Every model runs Hugging Face's SDPA
attention, which leaves out Gemma-2's attention-logit soft-capping (Hugging Face's eager, flash
and flex attention apply it, SDPA has no such option); the final-logit soft-capping stays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from barqtrain.train import shapes


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    config: dict[str, Any]  # the config class's keyword arguments, as in the model's config.json
    batch_size: int
    seq_len: int
    gradient_checkpointing: bool
    model_type: str = "llama"  # config.json's model_type: picks the config and model classes

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


LLAMA_1B = Workload(
    name="llama-1b",
    description="Llama-3.2-1B shape",
    config=dict(shapes.LLAMA_3_2_1B),
    batch_size=4,
    seq_len=2048,
    gradient_checkpointing=False,
)

LLAMA_8B = Workload(
    name="llama-8b",
    description="Llama-3.1-8B shape",
    config=dict(shapes.LLAMA_3_1_8B),
    batch_size=2,
    seq_len=4096,
    gradient_checkpointing=True,
)

# Llama-3-70B's config.json (the 3.0 model: 8K context, no RoPE scaling); bench scaling's QLoRA
# case, built layer by layer on several GPUs (not one of WORKLOADS: it fits no single GPU in 16 bits).
LLAMA_70B = Workload(
    name="llama-70b",
    description="Llama-3-70B shape",
    config=dict(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
    ),
    batch_size=1,
    seq_len=4096,
    gradient_checkpointing=True,
)

QWEN25_1_5B = Workload(
    name="qwen2.5-1.5b",
    description="Qwen2.5-1.5B shape",
    model_type="qwen2",  # q/k/v projections with biases: Qwen2's attention always has them
    config=dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=131072,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
    ),
    batch_size=4,
    seq_len=2048,
    gradient_checkpointing=False,
)

GEMMA2_2B = Workload(
    name="gemma2-2b",
    description="Gemma-2-2B shape",
    model_type="gemma2",
    config=dict(
        hidden_size=2304,
        intermediate_size=9216,
        num_hidden_layers=26,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        vocab_size=256000,
        max_position_embeddings=8192,
        query_pre_attn_scalar=256,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        sliding_window=4096,
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
    ),
    batch_size=4,
    seq_len=2048,
    gradient_checkpointing=False,
)

# Exercises the whole harness (processes, patching, checkpointing, PEFT) in seconds on a CPU.
TINY = Workload(
    name="tiny",
    description="tiny Llama for testing the harness",
    config=dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
    ),
    batch_size=2,
    seq_len=32,
    gradient_checkpointing=True,
)

WORKLOADS: dict[str, Workload] = {w.name: w for w in (LLAMA_1B, LLAMA_8B, QWEN25_1_5B, GEMMA2_2B, TINY)}
SELECTABLE_MODELS = tuple(name for name in WORKLOADS if name != TINY.name)  # what `--models` chooses from
BENCHMARK_MODELS = (LLAMA_1B.name, LLAMA_8B.name)  # `--models`' default


def build_model(workload: Workload, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """A randomly initialised causal LM of the workload's family, created directly on `device` in `dtype`.

    Creating it on the GPU avoids initialising 8B parameters on the CPU, which takes minutes.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(workload.model_type, **workload.config, use_cache=False)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model
