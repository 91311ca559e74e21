"""The ternary format on the CPU: the 2-bit layout bit by bit, the absmean quantizer (per
output channel and per group) against a float64 reference, the dequantized values, the GEMM
op's registration (opcheck), group_size's errors, and BitNet b1.58 layers' weights read as
they are against Transformers' own BitLinear and AutoBitLinear. The shared QLoRA tests (the
LoRA linear in float64, PEFT, streaming loading) run ternary among the other formats in
test_quant.py and test_loading.py; the CUDA GEMM's are in test_quant_gpu.py."""

from __future__ import annotations

import pytest
import torch
from barqtrain import quant
from barqtrain.ops import ternary
from barqtrain.quant.ternary import from_bitnet
from torch import nn


def fresh_weight(shape, dtype=torch.float32):
    """Fresh random values each run: a weight-like normal tensor with outliers and a zero row."""
    weight = torch.randn(shape) * 0.02
    weight.view(-1)[torch.randint(0, weight.numel(), (8,))] *= 20
    weight[0] = 0
    return weight.to(dtype)


def test_packing_places_weight_e_of_a_word_at_bit_2_e_div_2_plus_16_e_mod_2():
    codes = torch.randint(-1, 2, (3, 64), generator=torch.Generator().manual_seed(0))
    packed = ternary.pack_ternary(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 16)
    words = packed.view(torch.int32).long() & 0xFFFFFFFF  # little-endian 32-bit words, 16 weights each
    for e in range(16):
        stored = (words >> (2 * (e // 2) + 16 * (e % 2))) & 3
        assert torch.equal(stored, codes[:, e::16] + 1), f"weight {e} of each word"
    assert torch.equal(ternary.unpack_ternary(packed).long(), codes)


def absmean_reference(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(t, scale) in float64 from the definition: scale = mean |W| per group, t = clamp(round(W /
    scale), -1, 1), t 0 in a zero group."""
    groups = weight.double().reshape(weight.shape[0], -1, group_size)
    scales = groups.abs().mean(dim=-1, keepdim=True)
    t = torch.where(scales > 0, groups / scales.clamp(min=1e-300), 0.0).round().clamp(-1, 1)
    return t.reshape(weight.shape), scales.squeeze(-1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("group_size", [None, 32, 128])
def test_quantizer_is_the_absmean_rule(dtype, group_size):
    weight = fresh_weight((48, 256), dtype)
    original = weight.clone()
    packed = ternary.quantize_ternary(weight, group_size)
    assert torch.equal(weight, original), "the quantizer works on a copy"
    assert packed.shape == (48, 256) and packed.dtype == dtype and packed.group_size == (group_size or 256)
    t, scales = absmean_reference(weight, group_size or 256)
    torch.testing.assert_close(packed.scales.double(), scales, rtol=1e-6, atol=0)
    # fp32 and float64 quotients agree except within a rounding of the 0.5 threshold
    codes = ternary.unpack_ternary(packed.packed).double()
    quotient = weight.double().reshape(48, -1, group_size or 256) / scales.clamp(min=1e-300).unsqueeze(-1)
    clear = ((quotient.abs() - 0.5).abs() > 1e-5).reshape(48, 256)
    assert torch.equal(codes[clear], t[clear])
    assert not codes[0].any() and not packed.scales[0].any(), "a zero row: scale 0, every t 0"
    dense = ternary.dequantize_ternary(packed, torch.float64)
    expected = (codes.reshape(48, -1, group_size or 256) * packed.scales.double().unsqueeze(-1)).reshape(48, 256)
    assert torch.equal(dense, expected), "dequantized: t times the fp32 scale"
    assert torch.equal(ternary.dequantize_ternary(packed), expected.to(dtype)), "one rounding to the dtype"


def test_per_group_scales_fit_better_than_one_per_row():
    weight = fresh_weight((64, 512)) * torch.linspace(0.1, 3.0, 512)  # magnitudes drift along a row
    errors = [(ternary.dequantize_ternary(ternary.quantize_ternary(weight, g)) - weight).norm() for g in (None, 64)]
    assert errors[1] < 0.9 * errors[0]


@pytest.mark.parametrize("grad_input", [False, True])
@pytest.mark.parametrize("group_size", [None, 64])
def test_gemm_op_passes_opcheck(grad_input, group_size):
    packed = ternary.quantize_ternary(fresh_weight((96, 128)), group_size)
    a = torch.randn(5, 96 if grad_input else 128, requires_grad=True)
    torch.library.opcheck(torch.ops.barqtrain.matmul_ternary.default, (a, packed.packed, packed.scales, grad_input))


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="in_features a multiple of 32"):
        ternary.quantize_ternary(torch.randn(8, 48))
    with pytest.raises(ValueError, match=r"group_size must be a multiple of 32 that divides in_features \(128\)"):
        ternary.quantize_ternary(torch.randn(8, 128), 96)
    with pytest.raises(ValueError, match="group_size applies to quant_type ternary only"):
        quant.quantize_model(nn.Sequential(nn.Linear(64, 64)), "nf4", group_size=64)
    with pytest.raises(ValueError, match=r"group_size 64 does not divide 1's in_features 96"):
        quant.quantize_model(nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 64)), "ternary", group_size=64)
    weight = quant.LinearTernary.from_linear(nn.Linear(64, 32)).weight
    with pytest.raises(TypeError, match=r"not supported on a ternary weight.*dequantize"):
        weight.sum()
    with pytest.raises(ValueError, match="input must end in 32"):
        torch.randn(3, 5) @ weight
    with pytest.raises(ValueError, match=r"float32 scales \[32, groups\]"):
        quant.PackedTernary(weight.packed.packed, torch.ones(32, 3), torch.float32)


def test_ternary_linear_holds_2_bits_a_weight_and_a_scale_per_group():
    layer = quant.LinearTernary.from_linear(nn.Linear(256, 64, dtype=torch.bfloat16), group_size=128)
    assert layer.ternary_weight.shape == (64, 64) and layer.ternary_weight.dtype == torch.uint8
    assert layer.weight_scale.shape == (64, 2) and layer.weight_scale.dtype == torch.float32
    assert "ternary, group_size=128" in repr(layer)
    assert quant.is_quantized_linear(layer) and isinstance(quant.quantized_weight(layer), quant.WeightTernary)


@pytest.mark.parametrize("linear_class", ["bitlinear", "autobitlinear"])
def test_bitnet_weights_compute_as_transformers_layer_computes_them(linear_class):
    """A BitNet layer built by Transformers from a packed weight and its weight_scale, and the
    same two tensors read by from_bitnet, on inputs that its int8 activation quantization keeps
    exact (integers, each row's largest 127): the same outputs, and the same ternary values."""
    bitnet = pytest.importorskip("transformers.integrations.bitnet")
    generator = torch.Generator().manual_seed(5)
    t = torch.randint(-1, 2, (96, 128), generator=generator)
    packed = bitnet.pack_weights(t.clone())  # Transformers' packing adds 1 to its argument in place
    weight_scale = torch.tensor([0.37])
    layer_class = bitnet.BitLinear if linear_class == "bitlinear" else bitnet.AutoBitLinear
    x = torch.randint(-127, 128, (5, 128), generator=generator).float()
    x[:, 0] = 127
    with torch._dynamo.config.patch(disable=True):  # its quantizers are compiled; eager here
        layer = layer_class(128, 96, bias=False, dtype=torch.float32)
        layer.load_state_dict({"weight": packed, "weight_scale": weight_scale})
        expected = layer(x).double()
    weight = from_bitnet(packed, weight_scale, linear_class, torch.float32)
    assert torch.equal(ternary.unpack_ternary(weight.packed).long(), t)
    y = x.double() @ ternary.dequantize_ternary(weight, torch.float64).T
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-3 * expected.abs().max().item())


def test_bitnet_errors_name_the_problem():
    packed = torch.full((8, 64), 0b11, dtype=torch.uint8)
    with pytest.raises(ValueError, match="code 3"):
        from_bitnet(packed, torch.ones(1), "bitlinear", torch.bfloat16)
    with pytest.raises(ValueError, match="linear_class must be one of"):
        from_bitnet(packed, torch.ones(1), "bitnet", torch.bfloat16)
    with pytest.raises(ValueError, match="one value per tensor"):
        from_bitnet(packed, torch.ones(2), "autobitlinear", torch.bfloat16)
