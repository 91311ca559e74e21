"""LoRA without overhead: the LoRA linear, the projections of one input and the
gated MLP as autograd functions with hand-written backwards (functions.py).

PEFT models reach them through patching: barqtrain.get_peft_model (PEFT's own, then
patch_model; barqtrain.patch.peft_model) and patch_model's "lora" op (barqtrain.patch.lora).
"""

from barqtrain.lora.functions import LoraAdapter, Projection, lora_gated_mlp, lora_linear, lora_projections

__all__ = ["LoraAdapter", "Projection", "lora_gated_mlp", "lora_linear", "lora_projections"]
