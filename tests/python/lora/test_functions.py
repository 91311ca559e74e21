"""barqtrain.lora's functions against PEFT's layers on the same weights: outputs and the
gradients of x, A and B, each no further from a float64 reference than PEFT's own; what
they save for the backward; and the errors they raise."""

from __future__ import annotations

import pytest
import torch
from barqtrain.lora import LoraAdapter, Projection, lora_gated_mlp, lora_linear, lora_projections
from lora_testing import (
    assert_each_no_worse_than_peft,
    assert_no_worse_than_peft,
    barqtrain_projection,
    float64_copy,
    peft_arithmetic,
    peft_linear,
    relative_error,
    run,
)
from torch import nn

# (model dtype, adapters kept in float32 as PEFT's autocast_adapter_dtype does, BarqTrain's
# LoRA precision). "mixed" differs from "peft" only with fp32 adapters on a 16-bit model.
PRECISIONS = [
    (torch.float32, False, "peft"),
    (torch.bfloat16, False, "peft"),
    (torch.bfloat16, True, "peft"),
    (torch.bfloat16, True, "mixed"),
]
PRECISION_IDS = ["fp32", "bf16", "bf16-model-fp32-adapters-peft", "bf16-model-fp32-adapters-mixed"]


def _inputs(in_features: int, out_features: int, dtype: torch.dtype, device: str = "cpu"):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(3, 37, in_features, generator=generator).to(device=device, dtype=dtype)  # 111 rows
    dy = torch.randn(3, 37, out_features, generator=generator).to(device=device, dtype=dtype)
    return x, dy


def _check_against_peft(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor, precision: str = "peft") -> None:
    """Ours in `precision` no further from float64 than PEFT's arithmetic of that precision."""
    with peft_arithmetic(precision, x.device.type):
        theirs = run(layer, layer, x, dy)
    ours = run(lambda x: lora_linear(x, barqtrain_projection(layer, x, precision)), layer, x, dy)
    exact_layer = float64_copy(layer)
    exact = run(exact_layer, exact_layer, x.double(), dy.double())
    assert_no_worse_than_peft(ours, theirs, exact)


@pytest.mark.parametrize(("dtype", "fp32_adapters", "precision"), PRECISIONS, ids=PRECISION_IDS)
@pytest.mark.parametrize(("r", "use_rslora"), [(8, False), (256, True)], ids=["r8", "r256-rslora"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_lora_linear_is_no_worse_than_peft(dtype, fp32_adapters, precision, r, use_rslora, bias):
    layer = peft_linear(
        320, 200, r=r, dtype=dtype, bias=bias, use_rslora=use_rslora, autocast_adapter_dtype=fp32_adapters
    )
    assert layer.lora_A["default"].weight.dtype == (torch.float32 if fp32_adapters else dtype)
    if use_rslora:
        assert layer.scaling["default"] == pytest.approx((2 * r + 3) / r**0.5)
    _check_against_peft(layer, *_inputs(320, 200, dtype), precision)


@pytest.mark.parametrize(("dtype", "fp32_adapters", "precision"), PRECISIONS, ids=PRECISION_IDS)
def test_dropout_draws_peft_masks_and_backpropagates_through_them(dtype, fp32_adapters, precision):
    layer = peft_linear(96, 64, dtype=dtype, dropout=0.3, autocast_adapter_dtype=fp32_adapters)
    x, dy = _inputs(96, 64, dtype)
    x[0, :5] = 0.0  # zeros kept by the mask still pass a gradient to x

    torch.manual_seed(7)
    with peft_arithmetic(precision):
        theirs = run(layer, layer, x, dy)
    torch.manual_seed(7)
    ours = run(lambda x: lora_linear(x, barqtrain_projection(layer, x, precision)), layer, x, dy)

    # Same masks, so the same results up to rounding: products in bf16 round in other places
    # than PEFT (a few bf16 ulps, relative to the tensor), fp32 ones as PEFT does, where a bf16
    # result (y, dx) may still round a few elements the other way (summation order).
    bf16_products = layer.lora_A["default"].weight.dtype == torch.bfloat16 or precision == "mixed"
    for name, mine, expected in [("y", ours.y, theirs.y), *((n, ours.grads[n], theirs.grads[n]) for n in theirs.grads)]:
        tolerance = 1e-2 if bf16_products else 1e-6 if mine.dtype == torch.float32 else 1e-4
        assert relative_error(mine, expected.double()) <= tolerance, name


def test_dropout_is_off_in_eval_mode():
    layer = peft_linear(64, 48, dropout=0.5).eval()
    x, _ = _inputs(64, 48, torch.float32)
    torch.testing.assert_close(lora_linear(x, barqtrain_projection(layer, x)), layer(x), rtol=1e-6, atol=1e-6)


def test_a_trainable_base_weight_and_bias_get_their_gradients():
    layer = peft_linear(64, 48, bias=True)
    layer.base_layer.requires_grad_(True)
    _check_against_peft(layer, *_inputs(64, 48, torch.float32))


def _saved_activations(function, x: torch.Tensor, parameters: list[torch.Tensor]) -> list[torch.Size]:
    """Shapes of the tensors autograd saves while computing function(x), parameters excluded."""
    parameter_storages = {p.untyped_storage().data_ptr() for p in parameters}
    shapes = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.untyped_storage().data_ptr() not in parameter_storages:
            shapes.append(tensor.shape)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        function(x)
    return shapes


def test_lora_linear_saves_x_and_x_a_only_and_no_base_weight_gradient():
    layer = peft_linear(64, 48, r=8)
    x, dy = _inputs(64, 48, torch.float32)
    x.requires_grad_()
    projection = barqtrain_projection(layer, x)
    parameters = list(layer.parameters())

    saved = _saved_activations(lambda x: lora_linear(x, projection), x, parameters)
    assert sorted(saved) == sorted([torch.Size([111, 64]), torch.Size([111, 8])])  # x, x Aᵀ

    lora_linear(x, projection).backward(dy)
    assert layer.base_layer.weight.grad is None
    assert x.grad is not None and layer.lora_A["default"].weight.grad is not None


def _gated_mlp_layers(dtype: torch.dtype, hidden: int = 64, intermediate: int = 96, fp32_adapters: bool = False):
    layers = [
        peft_linear(hidden, intermediate, r=8, dtype=dtype, autocast_adapter_dtype=fp32_adapters),
        peft_linear(hidden, intermediate, r=8, dtype=dtype, autocast_adapter_dtype=fp32_adapters),
        peft_linear(intermediate, hidden, r=8, dtype=dtype, autocast_adapter_dtype=fp32_adapters),
    ]
    torch.manual_seed(2)
    with torch.no_grad():  # three different layers, not three copies of one seed's
        for layer in layers:
            for parameter in layer.parameters():
                parameter.add_(torch.randn_like(parameter) * parameter.std())
    return layers


class _PeftGatedMLP(nn.Module):
    def __init__(self, gate, up, down, activation):
        super().__init__()
        self.gate, self.up, self.down = gate, up, down
        self.act = nn.SiLU() if activation == "silu" else nn.GELU(approximate="tanh")

    def forward(self, x):
        return self.down(self.act(self.gate(x)) * self.up(x))


MLP_OUTPUTS = ("y", "x", *(f"{layer}.lora_{m}" for layer in ("gate", "up", "down") for m in "AB"))


def _mlp_grads(mlp: nn.Module, forward, x: torch.Tensor, dy: torch.Tensor) -> list[torch.Tensor]:
    """y and the gradients of x and of each layer's lora_A and lora_B, in MLP_OUTPUTS order."""
    x = x.detach().clone().requires_grad_()
    mlp.zero_grad(set_to_none=True)
    y = forward(x)
    y.backward(dy)
    return [y.detach(), x.grad] + [p.grad for p in mlp.parameters() if p.requires_grad]


def _barqtrain_mlp(mlp: _PeftGatedMLP, activation: str, precision: str = "peft"):
    def forward(x):
        gate, up, down = (barqtrain_projection(layer, x, precision) for layer in (mlp.gate, mlp.up, mlp.down))
        return lora_gated_mlp(x, [gate, up], down, activation)

    return forward


@pytest.mark.parametrize(("dtype", "fp32_adapters", "precision"), PRECISIONS, ids=PRECISION_IDS)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_mlp_is_no_worse_than_peft(dtype, fp32_adapters, precision, activation):
    mlp = _PeftGatedMLP(*_gated_mlp_layers(dtype, fp32_adapters=fp32_adapters), activation)
    x, dy = _inputs(64, 64, dtype)
    exact_mlp = float64_copy(mlp)
    exact = _mlp_grads(exact_mlp, exact_mlp, x.double(), dy.double())
    with peft_arithmetic(precision):
        theirs = _mlp_grads(mlp, mlp, x, dy)
    ours = _mlp_grads(mlp, _barqtrain_mlp(mlp, activation, precision), x, dy)
    assert_each_no_worse_than_peft(dict(zip(MLP_OUTPUTS, zip(ours, theirs, exact, strict=True), strict=True)))


def test_gated_mlp_saves_x_gate_up_and_the_small_intermediates_only():
    mlp = _PeftGatedMLP(*_gated_mlp_layers(torch.float32), "silu")
    x, _ = _inputs(64, 64, torch.float32)
    x.requires_grad_()
    saved = _saved_activations(_barqtrain_mlp(mlp, "silu"), x, list(mlp.parameters()))
    rows = 111
    # x; gate and up; x Aᵀ of gate and up side by side; h Aᵀ of down. Not act(gate) · up.
    expected = [(rows, 64), (rows, 96), (rows, 96), (rows, 16), (rows, 8)]
    assert sorted(tuple(shape) for shape in saved) == sorted(expected)


def test_fused_gate_up_projection_matches_separate_ones():
    gate, up, down = _gated_mlp_layers(torch.float32)
    x, dy = _inputs(64, 64, torch.float32)
    projections = [barqtrain_projection(layer, x) for layer in (gate, up, down)]
    fused = Projection(
        torch.cat([projections[0].weight, projections[1].weight]),
        None,
        LoraAdapter(
            torch.cat([projections[0].lora.lora_A, projections[1].lora.lora_A]),
            torch.block_diag(projections[0].lora.lora_B, projections[1].lora.lora_B),
            projections[0].lora.scaling,
        ),
    )
    expected = lora_gated_mlp(x, projections[:2], projections[2])
    torch.testing.assert_close(lora_gated_mlp(x, [fused], projections[2]), expected, rtol=1e-5, atol=1e-6)


def test_projections_of_one_input_match_one_by_one_and_save_x_once():
    layers = [peft_linear(64, n, r=r) for n, r in ((64, 8), (32, 16), (32, 4))]
    layers.append(nn.Linear(64, 16))  # a projection without an adapter, as k_proj in q,v-only targets
    x, _ = _inputs(64, 64, torch.float32)
    projections = [barqtrain_projection(layer, x) for layer in layers[:3]]
    projections.append(Projection(layers[3].weight.detach(), layers[3].bias.detach()))
    generator = torch.Generator().manual_seed(3)
    dys = [torch.randn(3, 37, p.weight.shape[0], generator=generator) for p in projections]

    def grads(outputs_of):
        xx = x.detach().clone().requires_grad_()
        for layer in layers[:3]:
            layer.zero_grad(set_to_none=True)
        torch.autograd.backward(outputs_of(xx), dys)
        return [xx.grad] + [layer.lora_A["default"].weight.grad for layer in layers[:3]]

    together = grads(lambda x: lora_projections(x, projections))
    one_by_one = grads(lambda x: [lora_linear(x, p) for p in projections])
    for mine, expected in zip(together, one_by_one, strict=True):
        torch.testing.assert_close(mine, expected, rtol=1e-5, atol=1e-6)

    parameters = [p for layer in layers for p in layer.parameters()]
    saved = _saved_activations(lambda x: lora_projections(x, projections), x.requires_grad_(), parameters)
    assert sorted(tuple(shape) for shape in saved) == [(111, 28), (111, 64)]  # x Aᵀ of all three; x


def test_wrong_shapes_and_dtypes_are_named():
    weight = torch.randn(48, 64)
    lora = LoraAdapter(torch.randn(8, 64), torch.randn(48, 8), 2.0)
    with pytest.raises(ValueError, match="input of size 32 does not fit a weight of shape"):
        lora_linear(torch.randn(5, 32), Projection(weight, None, lora))
    with pytest.raises(ValueError, match=r"lora_A must be \[r, in\] and lora_B \[out, r\]"):
        LoraAdapter(torch.randn(8, 64), torch.randn(48, 4), 2.0)
    with pytest.raises(ValueError, match="does not fit a weight of shape"):
        Projection(torch.randn(48, 32), None, lora)
    with pytest.raises(TypeError, match="input is torch.bfloat16 but the weight is torch.float32"):
        lora_linear(torch.randn(5, 64, dtype=torch.bfloat16), Projection(weight, None, lora))
    bf16_lora = LoraAdapter(lora.lora_A.bfloat16(), lora.lora_B.bfloat16(), 2.0)
    with pytest.raises(TypeError, match="adapter is computed in torch.bfloat16 with torch.float32 input"):
        lora_linear(torch.randn(5, 64), Projection(weight, None, bf16_lora))
    with pytest.raises(ValueError, match=r"LoRA dropout must be in \[0, 1\)"):
        LoraAdapter(lora.lora_A, lora.lora_B, 2.0, dropout=1.0)


CUDA_PRECISIONS = [(False, "peft"), (True, "peft"), (True, "mixed")]
CUDA_PRECISION_IDS = ["bf16-adapters", "fp32-adapters-peft", "fp32-adapters-mixed"]


@pytest.mark.gpu
@pytest.mark.parametrize(("fp32_adapters", "precision"), CUDA_PRECISIONS, ids=CUDA_PRECISION_IDS)
@pytest.mark.parametrize("r", [16, 256])
def test_lora_linear_on_cuda_in_bf16_is_no_worse_than_peft(fp32_adapters, precision, r):
    layer = peft_linear(4096, 1024, r=r, dtype=torch.bfloat16, autocast_adapter_dtype=fp32_adapters, device="cuda")
    _check_against_peft(layer, *_inputs(4096, 1024, torch.bfloat16, device="cuda"), precision)


@pytest.mark.gpu
@pytest.mark.parametrize(("fp32_adapters", "precision"), CUDA_PRECISIONS, ids=CUDA_PRECISION_IDS)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_mlp_on_cuda_in_bf16_is_no_worse_than_peft(fp32_adapters, precision, activation):
    layers = _gated_mlp_layers(torch.bfloat16, hidden=1024, intermediate=2816, fp32_adapters=fp32_adapters)
    mlp = _PeftGatedMLP(*layers, activation).cuda()
    x, dy = _inputs(1024, 1024, torch.bfloat16, device="cuda")
    exact_mlp = float64_copy(mlp)
    exact = _mlp_grads(exact_mlp, exact_mlp, x.double(), dy.double())
    with peft_arithmetic(precision, "cuda"):
        theirs = _mlp_grads(mlp, mlp, x, dy)
    ours = _mlp_grads(mlp, _barqtrain_mlp(mlp, activation, precision), x, dy)
    assert_each_no_worse_than_peft(dict(zip(MLP_OUTPUTS, zip(ours, theirs, exact, strict=True), strict=True)))
