"""barqtrain.quant on the CPU: the bitsandbytes layout bit for bit (bitsandbytes' CPU backend),
round trips, the GEMM ops' registration (opcheck), the QLoRA linear over a 4-bit or int8 base
against dequant-then-LoRA in float64, and a tiny Llama quantized by barqtrain (NF4, int8 and
ternary)
under PEFT: patched, trained with gradient checkpointing, and its adapter loaded on the
16-bit model. GPU tests (bitsandbytes' CUDA kernels, the fused GEMM,
50 QLoRA steps against bitsandbytes + PEFT) are in test_quant_gpu.py."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import barqtrain
import peft
import pytest
import torch
from barqtrain import quant
from barqtrain.lora import LoraAdapter
from barqtrain.ops import quant as quant_ops
from barqtrain.patch import patch_model
from barqtrain.quant.linear import quantized_linear
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "patch"))
from tiny_models import plain_batch, tiny_model

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def fresh_weight(shape, dtype, scale=0.02):
    """Fresh random values each run (no fixed seed): a weight-like normal tensor with a few
    outliers and one block of zeros."""
    weight = torch.randn(shape) * scale
    weight.view(-1)[torch.randint(0, weight.numel(), (8,))] *= 20
    weight.view(-1)[:64] = 0
    return weight.to(dtype)


@pytest.fixture(scope="module")
def bnb_functional():
    return pytest.importorskip("bitsandbytes.functional")


def test_dynamic_code_is_bitsandbytes_map(bnb_functional):
    assert torch.equal(quant.dynamic_code(), bnb_functional.create_dynamic_map(signed=True))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nf4_quantize_is_bit_exact_with_bitsandbytes_cpu(bnb_functional, dtype):
    weight = fresh_weight((96, 320), dtype)
    packed, absmax = torch.ops.barqtrain.quantize_4bit(weight, "nf4")
    bnb_packed, state = bnb_functional.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=False)
    assert torch.equal(packed, bnb_packed)
    assert torch.equal(absmax, state.absmax)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dequantize_is_bit_exact_with_bitsandbytes_cpu_double_quantized(bnb_functional, quant_type, dtype):
    weight = fresh_weight((64, 512), dtype)
    bnb_packed, state = bnb_functional.quantize_4bit(weight, blocksize=64, quant_type=quant_type, compress_statistics=True)
    packed = quant.Packed4bit(bnb_packed, state.absmax, (64, 512), dtype, quant_type, state.state2.code,
                              state.state2.absmax, state.offset)  # fmt: skip
    expected = bnb_functional.dequantize_4bit(bnb_packed, state)
    restored = quant.dequantize_4bit(packed)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    if quant_type == "fp4":
        # FP4 code 0b1000 is -0.0 in bitsandbytes' CUDA kernels (and barqtrain's), +0.0 in its
        # CPU backend: equal values, one sign bit apart.
        restored, expected = restored + 0.0, expected + 0.0
    assert torch.equal(restored.view(bits), expected.view(bits))


def test_double_quantization_agrees_with_bitsandbytes_cpu(bnb_functional):
    """bitsandbytes' CPU 8-bit quantizer rounds the value to a 65536-step grid and looks the
    code up there; its CUDA kernel (and barqtrain, on both devices) searches the code exactly.
    So barqtrain's index is the nearest code value, and bitsandbytes' CPU one is as near to
    within the grid's resolution."""
    absmax = fresh_weight((4096, 64), torch.float32, scale=1.0).abs().amax(dim=1) + 0.01
    code = quant.dynamic_code()
    quantized, absmax2, offset = torch.ops.barqtrain.quantize_absmax(absmax, code)
    assert torch.equal(offset, absmax.mean())
    bnb_quantized, bnb_state = bnb_functional.quantize_blockwise(absmax - offset, code=code, blocksize=256)
    assert torch.equal(absmax2, bnb_state.absmax)
    normalized = (absmax - offset) * (1.0 / absmax2).repeat_interleave(256)[: absmax.numel()]  # as quantized
    ours = (code[quantized.long()] - normalized).abs()
    theirs = (code[bnb_quantized.long()] - normalized).abs()
    nearest = (code[None, :] - normalized[:, None]).abs().amin(dim=1)
    assert torch.equal(ours, nearest), "barqtrain's index is not the nearest code value"
    assert (theirs - ours <= 2 / 65535).all()
    assert (quantized == bnb_quantized).float().mean() > 0.99


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_round_trip_error_is_the_codes_resolution(quant_type, double_quant):
    weight = fresh_weight((128, 256), torch.float32)
    packed = quant.quantize_4bit(weight, quant_type, double_quant)
    restored = quant.dequantize_4bit(packed)
    blocks, restored_blocks = weight.reshape(-1, 64), restored.reshape(-1, 64)
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    # Half the widest gap between neighbouring code values, plus the absmax's 8-bit error.
    bound = (0.17 if quant_type == "nf4" else 0.34) * absmax + (0.02 * absmax if double_quant else 0)
    assert ((blocks - restored_blocks).abs() <= bound).all()
    assert torch.equal(restored_blocks[0], torch.zeros(64))  # the block of zeros


def test_int8_rows_round_trip():
    x = fresh_weight((37, 1000), torch.bfloat16, scale=1.0)
    q, row_absmax = quant_ops.quantize_int8_rows(x)
    assert q.dtype == torch.int8 and torch.equal(row_absmax, x.float().abs().amax(dim=1))
    assert q[1:].abs().amax(dim=1).eq(127).all()
    restored = quant_ops.dequantize_int8_rows(q, row_absmax, torch.float32)
    assert ((restored - x.float()).abs() <= row_absmax.unsqueeze(1) / 254 * 1.01 + 1e-6).all()


def test_int8_weight_is_the_int8_rows_ops():
    weight = fresh_weight((48, 160), torch.bfloat16, scale=1.0)
    packed = quant.quantize_int8(weight)
    q, row_absmax = quant_ops.quantize_int8_rows(weight)
    assert packed.shape == (48, 160) and packed.dtype == torch.bfloat16
    assert torch.equal(packed.q, q) and torch.equal(packed.row_absmax, row_absmax)
    assert torch.equal(quant.dequantize_int8(packed), quant_ops.dequantize_int8_rows(q, row_absmax, torch.bfloat16))


@pytest.mark.parametrize("grad_input", [False, True])
def test_gemm_ops_pass_opcheck(grad_input):
    weight = fresh_weight((96, 128), torch.float32)
    packed4, packed8 = quant.quantize_4bit(weight), quant.quantize_int8(weight)
    a = torch.randn(5, 96 if grad_input else 128, requires_grad=True)
    torch.library.opcheck(torch.ops.barqtrain.matmul_4bit.default,
                          (a, *packed4.op_args(), *packed4.shape, grad_input))  # fmt: skip
    torch.library.opcheck(torch.ops.barqtrain.matmul_int8.default, (a, packed8.q, packed8.row_absmax, grad_input))


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="quant_type must be one of"):
        quant.quantize_4bit(torch.randn(64, 64), "int4")
    with pytest.raises(ValueError, match="multiple of 64"):
        quant.quantize_4bit(torch.randn(64, 100))
    weight = quant.Linear4bit.from_linear(nn.Linear(64, 32)).weight
    with pytest.raises(TypeError, match=r"not supported on a 4-bit weight.*dequantize"):
        weight.sum()
    with pytest.raises(ValueError, match="input must end in 64"):
        torch.nn.functional.linear(torch.randn(3, 32), weight)
    int8_weight = quant.Linear8bit.from_linear(nn.Linear(64, 32)).weight
    with pytest.raises(TypeError, match=r"not supported on a int8 weight.*dequantize"):
        int8_weight.sum()
    with pytest.raises(ValueError, match="input must end in 32"):
        torch.randn(3, 5) @ int8_weight  # dy W: dy must end in out_features
    with pytest.raises(ValueError, match=r"quant_type must be one of \('nf4', 'fp4', 'int8', 'ternary'\)"):
        quant.quantize_model(nn.Sequential(nn.Linear(64, 64)), "int4")


def linear_of(quant_type, in_features, out_features):
    return quantized_linear(nn.Linear(in_features, out_features, dtype=torch.float64), quant_type)


@pytest.mark.parametrize("quant_type", ["nf4", "int8", "ternary"])
def test_quantized_matmul_and_its_gradient_match_the_dequantized_weight(quant_type):
    linear = linear_of(quant_type, 192, 80)
    dense = linear.weight.dequantize(torch.float64)
    x = torch.randn(7, 192, dtype=torch.float64, requires_grad=True)
    y = linear(x)
    grad = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, grad)
    torch.testing.assert_close(y, x @ dense.T + linear.bias, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx, grad @ dense, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("quant_type", ["nf4", "int8", "ternary"])
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_qlora_linear_matches_dequant_then_lora_in_float64(dropout, quant_type):
    linear = linear_of(quant_type, 128, 96)
    dense = linear.weight.dequantize(torch.float64)
    lora_A = torch.randn(8, 128, dtype=torch.float64, requires_grad=True)
    lora_B = torch.randn(96, 8, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 5, 128, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(3)
    y = quant.qlora_linear(x, linear.weight, LoraAdapter(lora_A, lora_B, 2.5, dropout), linear.bias)
    grad = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, lora_A, lora_B), grad)
    torch.manual_seed(3)
    dropped = torch.nn.functional.dropout(x, dropout) if dropout else x
    expected = x @ dense.T + linear.bias + 2.5 * (dropped @ lora_A.T) @ lora_B.T
    expected_grads = torch.autograd.grad(expected, (x, lora_A, lora_B), grad)
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("quant_type", ["nf4", "int8", "ternary"])
def test_quantize_model_keeps_layers_the_format_cannot_take_in_16_bits(quant_type):
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 12), nn.Linear(40, 64))  # out 12, in 40: kept
    assert quant.quantize_model(model, quant_type) == ["0"]
    assert [type(m) for m in model] == [type(model[0]), nn.Linear, nn.Linear] and type(model[0]) is not nn.Linear


def lora_config(**overrides):
    options = dict(task_type="CAUSAL_LM", r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    return peft.LoraConfig(**{**options, **overrides})


def quantized_tiny_llama(quant_type="nf4"):
    model = tiny_model("llama")
    replaced = quant.quantize_model(model, quant_type)
    assert len(replaced) == 14 and "lm_head" not in replaced
    return model


@pytest.mark.parametrize("quant_type", ["nf4", "int8", "ternary"])
def test_quantized_tiny_llama_under_peft_is_patched_and_computes_as_peft(quant_type):
    reference = barqtrain.get_peft_model(quantized_tiny_llama(quant_type), lora_config(), ops=())
    model = copy.deepcopy(reference)
    report = patch_model(model)
    assert report.patched_count("lora") == 14, str(report)
    batch = plain_batch()
    losses, grads = [], []
    for m in (reference, model):
        m.zero_grad(set_to_none=True)
        loss = m(**batch).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in m.named_parameters() if p.requires_grad})
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    assert grads[0].keys() == grads[1].keys() and all("lora_" in name for name in grads[0])
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("quant_type", ["nf4", "int8", "ternary"])
def test_quantized_training_with_gradient_checkpointing_and_adapter_on_the_16bit_model(tmp_path, quant_type):
    model = barqtrain.get_peft_model(quantized_tiny_llama(quant_type), lora_config())
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    ids = torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(4))
    losses = []
    for _ in range(20):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0]
    model.save_pretrained(tmp_path)
    loaded = peft.PeftModel.from_pretrained(tiny_model("llama"), tmp_path)  # the 16-bit base
    trained = {n: p for n, p in model.named_parameters() if "lora_" in n}
    for name, parameter in loaded.named_parameters():
        if "lora_" in name:
            torch.testing.assert_close(parameter, trained[name], rtol=0, atol=0)


def test_bitsandbytes_linear4bit_base_is_read_as_it_is():
    bnb = pytest.importorskip("bitsandbytes")
    weight = fresh_weight((96, 128), torch.bfloat16)
    layer = bnb.nn.Linear4bit(128, 96, bias=True, compute_dtype=torch.bfloat16, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4", compress_statistics=True)
    layer = layer.to(torch.bfloat16).to("cpu")
    assert layer.weight.quant_state.nested
    read = quant.quantized_weight(layer)
    assert isinstance(read, quant.Weight4bit)
    expected = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
    assert torch.equal(read.dequantize(), expected)
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    torch.testing.assert_close(torch.nn.functional.linear(x, read, layer.bias), layer(x), rtol=2e-2, atol=2e-2)
