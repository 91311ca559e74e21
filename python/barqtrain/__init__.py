"""BarqTrain: fused CUDA C++ kernels and a lean trainer for fine-tuning Hugging Face models."""

from barqtrain import lora, memory, ops
from barqtrain.memory import enable_gradient_checkpointing
from barqtrain.patch import (
    PatchReport,
    apply_to_gemma,
    apply_to_gemma2,
    apply_to_gemma3,
    apply_to_llama,
    apply_to_mistral,
    apply_to_phi3,
    apply_to_qwen2,
    apply_to_qwen3,
    patch_model,
    revert_class_patches,
    set_shifted_sparse_attention,
    unpatch_model,
)
from barqtrain.patch.compile import compile_decoder_layers
from barqtrain.patch.peft_model import get_peft_model

__version__ = "0.1.0"

__all__ = [
    "PatchReport",
    "apply_to_gemma",
    "apply_to_gemma2",
    "apply_to_gemma3",
    "apply_to_llama",
    "apply_to_mistral",
    "apply_to_phi3",
    "apply_to_qwen2",
    "apply_to_qwen3",
    "compile_decoder_layers",
    "enable_gradient_checkpointing",
    "get_peft_model",
    "lora",
    "memory",
    "ops",
    "patch_model",
    "revert_class_patches",
    "set_shifted_sparse_attention",
    "unpatch_model",
    "__version__",
]
