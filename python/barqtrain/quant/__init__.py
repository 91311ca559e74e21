"""QLoRA (SPEC K7): 4-bit base weights in the bitsandbytes layout, computed by the fused
dequant-GEMM, under barqtrain's LoRA functions.

    model = barqtrain.quant.load_4bit("path/to/model")      # or quantize_model(model)
    model = barqtrain.get_peft_model(model, LoraConfig(...))  # QLoRA, no bitsandbytes needed

A model loaded by bitsandbytes (BitsAndBytesConfig(load_in_4bit=True, ...)) is read as it
is: patch_model computes its PEFT LoRA layers the same way (see docs/qlora.md).
"""

from barqtrain.ops.quant import (
    Packed4bit,
    dequantize_4bit,
    dynamic_code,
    matmul_4bit,
    quantize_4bit,
)
from barqtrain.quant.functions import qlora_linear
from barqtrain.quant.linear import (
    Linear4bit,
    load_4bit,
    quantize_model,
    quantized_weight,
)
from barqtrain.quant.weight import Weight4bit, from_bitsandbytes

__all__ = [
    "Linear4bit",
    "Packed4bit",
    "Weight4bit",
    "dequantize_4bit",
    "dynamic_code",
    "from_bitsandbytes",
    "load_4bit",
    "matmul_4bit",
    "qlora_linear",
    "quantize_4bit",
    "quantize_model",
    "quantized_weight",
]
