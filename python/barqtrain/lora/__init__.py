"""LoRA without overhead: the LoRA linear, the projections of one input and the
gated MLP as autograd functions with hand-written backwards (functions.py), and
get_peft_model, PEFT's own with BarqTrain's patching applied (peft_model.py).

    model = barqtrain.get_peft_model(model, LoraConfig(r=16, target_modules="all-linear"))

patch_model does the same to a model PEFT made (its "lora" op): see barqtrain.patch.lora.
"""

from barqtrain.lora.functions import LoraAdapter, Projection, lora_gated_mlp, lora_linear, lora_projections
from barqtrain.lora.peft_model import get_peft_model

__all__ = ["LoraAdapter", "Projection", "get_peft_model", "lora_gated_mlp", "lora_linear", "lora_projections"]
