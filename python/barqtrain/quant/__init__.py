"""QLoRA: 4-bit base weights in the bitsandbytes layout, int8 ones with an absmax per row, or
ternary ones ({-1, 0, +1} with an absmean scale, 2 bits a weight), computed by the fused
dequant-GEMMs, under barqtrain's LoRA functions.

    model = barqtrain.quant.load_4bit("path/to/model")      # streamed; or quantize_model(model)
    model = barqtrain.quant.load_quantized("path/to/model", quant_type="int8")   # or "ternary"
    model = barqtrain.get_peft_model(model, LoraConfig(...))  # QLoRA, no bitsandbytes needed

A model loaded by bitsandbytes (BitsAndBytesConfig(load_in_4bit=True, ...)) is read as it
is: patch_model computes its PEFT LoRA layers the same way (see docs/qlora.md).
"""

from barqtrain.ops.quant import (
    DEQUANTIZE_THEN_GEMM_ROWS,
    Packed4bit,
    Packed8bit,
    dequantize_4bit,
    dequantize_int8,
    dynamic_code,
    matmul_4bit,
    matmul_int8,
    quantize_4bit,
    quantize_int8,
)
from barqtrain.ops.ternary import (
    PackedTernary,
    dequantize_ternary,
    matmul_ternary,
    quantize_ternary,
)
from barqtrain.quant.functions import qlora_linear
from barqtrain.quant.linear import (
    QUANT_TYPES,
    Linear4bit,
    Linear8bit,
    LinearTernary,
    is_quantized_linear,
    quantize_model,
    quantized_weight,
)
from barqtrain.quant.loading import load_4bit, load_quantized
from barqtrain.quant.ternary import from_bitnet
from barqtrain.quant.weight import (
    QuantizedWeight,
    Weight4bit,
    Weight8bit,
    WeightTernary,
    from_bitsandbytes,
)

__all__ = [
    "DEQUANTIZE_THEN_GEMM_ROWS",
    "QUANT_TYPES",
    "Linear4bit",
    "Linear8bit",
    "LinearTernary",
    "Packed4bit",
    "Packed8bit",
    "PackedTernary",
    "QuantizedWeight",
    "Weight4bit",
    "Weight8bit",
    "WeightTernary",
    "dequantize_4bit",
    "dequantize_int8",
    "dequantize_ternary",
    "dynamic_code",
    "from_bitnet",
    "from_bitsandbytes",
    "is_quantized_linear",
    "load_4bit",
    "load_quantized",
    "matmul_4bit",
    "matmul_int8",
    "matmul_ternary",
    "qlora_linear",
    "quantize_4bit",
    "quantize_int8",
    "quantize_ternary",
    "quantize_model",
    "quantized_weight",
]
