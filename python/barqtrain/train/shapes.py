"""The real model shapes the trainer can build at random (`model: {name: llama-1b-shape}`), as
LlamaConfig keyword arguments from the models' config.json: for throughput and memory runs
without downloading weights. `barqtrain bench` trains the same shapes."""

from __future__ import annotations

from typing import Any


def _llama3(
    hidden: int, intermediate: int, layers: int, head_dim: int, rope_factor: float, tied: bool
) -> dict[str, Any]:
    """What Llama 3.1 and 3.2 share (GQA of 8 kv heads out of 32, the 128,256 vocabulary, the
    llama3 RoPE scaling of a 500,000 base), with each model's own sizes."""
    return dict(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=head_dim,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=rope_factor,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        tie_word_embeddings=tied,
        rms_norm_eps=1e-5,
    )


LLAMA_3_2_1B = _llama3(hidden=2048, intermediate=8192, layers=16, head_dim=64, rope_factor=32.0, tied=True)
LLAMA_3_1_8B = _llama3(hidden=4096, intermediate=14336, layers=32, head_dim=128, rope_factor=8.0, tied=False)
