"""barqtrain.quant on a GPU: bit-exact with bitsandbytes' CUDA kernels (quantize, double
quantization, dequantize), the fused 4-bit, int8 and ternary dequant-GEMMs against float64, 50
QLoRA steps of a tiny Llama matching bitsandbytes + PEFT, and the device memory peak of
streaming quantized loading. Each test says what it compares in its failure."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import barqtrain
import peft
import pytest
import torch
import transformers
from barqtrain import quant
from barqtrain.patch import patch_model
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "patch"))
from tiny_models import memorized_batch, tiny_model, train_losses

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def bnb():
    return pytest.importorskip("bitsandbytes")


def fresh_weight(shape, dtype):
    weight = torch.randn(shape, device="cuda") * 0.02
    weight.view(-1)[:64] = 0
    return weight.to(dtype)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_quantize_and_dequantize_are_bit_exact_with_bitsandbytes_cuda(bnb, quant_type, dtype):
    weight = fresh_weight((1024, 1536), dtype)
    bnb_packed, state = bnb.functional.quantize_4bit(weight, blocksize=64, quant_type=quant_type,
                                                     compress_statistics=True)  # fmt: skip
    packed = quant.quantize_4bit(weight, quant_type, double_quant=True)
    assert torch.equal(packed.packed, bnb_packed), "4-bit codes differ from bitsandbytes'"
    assert torch.equal(packed.absmax2, state.state2.absmax), "absmax2 differs"
    assert torch.equal(packed.absmax_offset, state.offset), "offset (mean of absmax) differs"
    assert torch.equal(packed.absmax, state.absmax), "double-quantized absmax indices differ"
    restored = quant.dequantize_4bit(packed)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(restored.view(bits), bnb.functional.dequantize_4bit(bnb_packed, state).view(bits))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("m", "n", "k"), [(333, 1024, 512), (1, 192, 64), (1023, 4096, 1024), (1031, 4096, 1024)])
def test_4bit_gemm_is_no_worse_than_torch_on_the_dequantized_weight(bnb, dtype, m, n, k):
    packed = quant.quantize_4bit(fresh_weight((n, k), dtype))
    dense = quant.dequantize_4bit(packed)
    for grad_input, a_cols in ((False, k), (True, n)):
        a = torch.randn(m, a_cols, device="cuda", dtype=dtype)
        exact = a.double() @ (dense.double() if grad_input else dense.double().T)
        ours = quant.matmul_4bit(a, packed, grad_input=grad_input)
        torch_out = a @ (dense if grad_input else dense.T)
        error = (ours.double() - exact).norm() / exact.norm()
        torch_error = (torch_out.double() - exact).norm() / exact.norm()
        assert error <= 1.5 * torch_error + 1e-6, f"grad_input={grad_input}: {error} vs torch's {torch_error}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("m", "n", "k"),
                         [(333, 1024, 512), (1, 200, 16), (1023, 4096, 1040), (1031, 4096, 1040), (77, 4104, 4096)])
def test_int8_gemm_is_no_worse_than_torch_on_the_dequantized_weight(dtype, m, n, k):
    weight = fresh_weight((n, k), dtype)
    weight[1] *= 30  # rows of very different scales
    packed = quant.quantize_int8(weight)
    exact_weight = packed.q.double() * packed.row_absmax.double().unsqueeze(1) / 127  # what the int8 weight stands for
    dense = quant.dequantize_int8(packed)  # dequantize-then-matmul: W rounded to the 16-bit dtype
    for grad_input, a_cols in ((False, k), (True, n)):
        a = torch.randn(m, a_cols, device="cuda", dtype=dtype)
        exact = a.double() @ (exact_weight if grad_input else exact_weight.T)
        ours = quant.matmul_int8(a, packed, grad_input=grad_input)
        torch_out = a @ (dense if grad_input else dense.T)
        error = (ours.double() - exact).norm() / exact.norm()
        torch_error = (torch_out.double() - exact).norm() / exact.norm()
        assert error <= 1.5 * torch_error + 1e-6, f"grad_input={grad_input}: {error} vs torch's {torch_error}"
        if grad_input:  # the backward multiplies by the 16-bit dequantized weight itself
            dense_exact = a.double() @ dense.double()
            assert (ours.double() - dense_exact).norm() / dense_exact.norm() <= 1.5 * torch_error + 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("group_size", [None, 32])
@pytest.mark.parametrize(("m", "n", "k"), [(333, 1024, 512), (1, 200, 32), (1031, 4096, 1056), (77, 4104, 4096)])
def test_ternary_gemm_is_no_worse_than_torch_on_the_dequantized_weight(dtype, group_size, m, n, k):
    weight = fresh_weight((n, k), dtype)
    weight[1] *= 30  # rows of very different scales
    packed = quant.quantize_ternary(weight, group_size)
    dense = quant.dequantize_ternary(packed)  # t * scale rounded once: the values the GEMM multiplies by
    for grad_input, a_cols in ((False, k), (True, n)):
        a = torch.randn(m, a_cols, device="cuda", dtype=dtype)
        exact = a.double() @ (dense.double() if grad_input else dense.double().T)
        ours = quant.matmul_ternary(a, packed, grad_input=grad_input)
        torch_out = a @ (dense if grad_input else dense.T)
        error = (ours.double() - exact).norm() / exact.norm()
        torch_error = (torch_out.double() - exact).norm() / exact.norm()
        assert error <= 1.5 * torch_error + 1e-6, f"grad_input={grad_input}: {error} vs torch's {torch_error}"


QUANTIZERS = {"nf4": (quant.quantize_4bit, quant.dequantize_4bit, quant.matmul_4bit),
              "int8": (quant.quantize_int8, quant.dequantize_int8, quant.matmul_int8),
              "ternary": (quant.quantize_ternary, quant.dequantize_ternary, quant.matmul_ternary)}


@pytest.mark.parametrize("fmt", list(QUANTIZERS))
@pytest.mark.parametrize("grad_input", [False, True])
def test_gemm_dequantizes_for_cublas_from_the_switch_row_count_on(fmt, grad_input):
    """Below DEQUANTIZE_THEN_GEMM_ROWS rows the fused kernel never holds a 16-bit weight; from
    there on the op holds one for the call only and returns cuBLAS's product on it, bit for bit."""
    torch.manual_seed(0)
    weight = fresh_weight((4096, 4096), torch.bfloat16)
    quantize, dequantize, matmul = QUANTIZERS[fmt]
    packed = quantize(weight)
    dense = dequantize(packed)
    switch = quant.DEQUANTIZE_THEN_GEMM_ROWS
    for rows in (switch - 1, switch):
        a = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
        cublas = a @ (dense if grad_input else dense.T)  # also allocates cuBLAS's workspace before the count
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        ours = matmul(a, packed, grad_input=grad_input)
        held = torch.cuda.max_memory_allocated() - before - ours.nbytes
        assert torch.cuda.memory_allocated() == before + ours.nbytes, f"{rows} rows: the op left memory allocated"
        if rows < switch:
            assert held < dense.nbytes // 4, f"{rows} rows: {held} bytes held beside C, a 16-bit weight is {dense.nbytes}"
        else:
            assert held >= dense.nbytes, f"{rows} rows: {held} bytes held beside C, less than the 16-bit weight"
            assert torch.equal(ours, cublas), f"{rows} rows: not cuBLAS's product on the dequantized weight"
        del ours, cublas  # before the next count


def test_dequantized_for_follows_the_ops_rule():
    """QuantizedWeight.dequantized_for gives the 16-bit weight exactly where the op would write it
    for cuBLAS, and never where autograd would keep it for the backward pass."""
    weight = fresh_weight((256, 128), torch.bfloat16)
    switch = quant.DEQUANTIZE_THEN_GEMM_ROWS
    few, many = (torch.randn(rows, 128, device="cuda", dtype=torch.bfloat16) for rows in (switch - 1, switch))
    for quantized in (quant.Weight4bit(quant.quantize_4bit(weight)), quant.Weight8bit(quant.quantize_int8(weight)),
                      quant.WeightTernary(quant.quantize_ternary(weight))):  # fmt: skip
        assert torch.equal(quantized.dequantized_for(many), quantized.dequantize()), quantized
        assert quantized.dequantized_for(few) is None, quantized
        assert quantized.dequantized_for(many.cpu()) is None, quantized
        assert quantized.dequantized_for(many.clone().requires_grad_()) is None, quantized
        with torch.no_grad():
            assert quantized.dequantized_for(many.clone().requires_grad_()) is not None, quantized


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_qlora_linear_from_the_switch_on_is_the_lora_linear_on_the_dequantized_weight(fmt):
    """From DEQUANTIZE_THEN_GEMM_ROWS rows on, the LoRA term joins the base GEMM's epilogue as it
    does over a 16-bit base: the forward is bit for bit the bf16 LoRA linear's on the dequantized
    weight, and the gradients are as close to float64 as that linear's."""
    from barqtrain.lora import LoraAdapter, Projection, lora_linear

    torch.manual_seed(0)
    weight = fresh_weight((1024, 512), torch.bfloat16)
    if fmt == "nf4":
        quantized = quant.Weight4bit(quant.quantize_4bit(weight))
    else:
        quantized = quant.Weight8bit(quant.quantize_int8(weight))
    dense = quantized.dequantize()
    lora_A = (torch.randn(16, 512, device="cuda") * 0.05).requires_grad_()
    lora_B = (torch.randn(1024, 16, device="cuda") * 0.05).requires_grad_()
    x = torch.randn(quant.DEQUANTIZE_THEN_GEMM_ROWS, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(x.shape[0], 1024, device="cuda", dtype=torch.bfloat16)
    results = {}
    for name, base in (("quantized", quantized), ("dense", dense)):
        inputs = [t.detach().clone().requires_grad_() for t in (x, lora_A, lora_B)]
        y = lora_linear(inputs[0], Projection(base, None, LoraAdapter(inputs[1], inputs[2], 2.0)))
        y.backward(dy)
        results[name] = (y, *(t.grad for t in inputs))
    assert torch.equal(results["quantized"][0], results["dense"][0]), "the forward is not the bf16 LoRA linear's"
    w, a, b, x64, dy64 = (t.detach().double() for t in (dense, lora_A, lora_B, x, dy))
    exact = {"dx": dy64 @ w + 2.0 * (dy64 @ b) @ a, "dA": 2.0 * (dy64 @ b).T @ x64, "dB": 2.0 * dy64.T @ (x64 @ a.T)}
    for position, what in enumerate(exact, start=1):
        error = (results["quantized"][position].double() - exact[what]).norm() / exact[what].norm()
        dense_error = (results["dense"][position].double() - exact[what]).norm() / exact[what].norm()
        assert error <= 1.5 * dense_error + 1e-6, f"{what}: {error} vs the bf16 linear's {dense_error}"


FUSED_GEMMS_IN_A_NEW_THREAD = """
import threading, torch
from barqtrain import quant
torch.manual_seed(0)
weight = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
gemms = [(quant.matmul_4bit, quant.quantize_4bit(weight)), (quant.matmul_int8, quant.quantize_int8(weight)),
         (quant.matmul_ternary, quant.quantize_ternary(weight))]
inputs = {cols: torch.randn(64, cols, device="cuda", dtype=torch.bfloat16) for cols in (256, 512)}
del weight
torch.empty(64 << 20, device="cuda", dtype=torch.uint8)  # freed at once: the thread's outputs reuse it, no cudaMalloc
results = []

def body():
    for matmul, packed in gemms:
        for grad_input in (False, True):
            results.append(matmul(inputs[512 if grad_input else 256], packed, grad_input=grad_input))
    torch.cuda.synchronize()

thread = threading.Thread(target=body)
thread.start()
thread.join()
assert len(results) == 6 and all(r.isfinite().all() for r in results), "the thread's GEMMs did not all finish"
print("OK")
"""


def test_fused_gemms_run_in_a_new_host_thread():
    """A host thread that has called no CUDA runtime function has no current CUDA context until
    one does; the Hopper GEMMs encode their TMA descriptors through the driver, which needs one
    (such a thread crashed there). In a child process, so that a crash fails this test alone."""
    run = subprocess.run([sys.executable, "-c", FUSED_GEMMS_IN_A_NEW_THREAD], capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert run.returncode == 0 and "OK" in run.stdout, f"exit {run.returncode}: {run.stderr[-3000:]}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("group_size", [None, 64])
def test_ternary_dequantization_is_bit_exact_with_the_cpu_reference(dtype, group_size):
    weight = fresh_weight((300, 512), torch.bfloat16)
    weight[1] *= 30  # rows of very different scales
    packed = quant.quantize_ternary(weight, group_size)
    on_cpu = quant.PackedTernary(packed.packed.cpu(), packed.scales.cpu(), packed.dtype)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    restored, reference = quant.dequantize_ternary(packed, dtype), quant.dequantize_ternary(on_cpu, dtype)
    assert torch.equal(restored.cpu().view(bits), reference.view(bits)), "the CUDA kernel's bits differ from the CPU's"


def test_ternary_quantizer_agrees_with_the_cpu_reference():
    weight = fresh_weight((512, 1024), torch.bfloat16)
    on_gpu, on_cpu = quant.quantize_ternary(weight, 128), quant.quantize_ternary(weight.cpu(), 128)
    torch.testing.assert_close(on_gpu.scales.cpu(), on_cpu.scales, rtol=1e-6, atol=0)
    differing = (on_gpu.packed.cpu() != on_cpu.packed).float().mean().item()
    assert differing < 1e-3, f"{differing:.2%} of the packed bytes differ (only exact ties of |W| / scale = 0.5 may)"


def test_int8_linear_gradient_is_the_backward_gemm():
    linear = quant.Linear8bit.from_linear(nn.Linear(256, 72, device="cuda", dtype=torch.bfloat16))
    x = torch.randn(2, 37, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = linear(x)
    grad = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, grad)
    torch.testing.assert_close(dx, quant.matmul_int8(grad, linear.weight.packed, grad_input=True), rtol=0, atol=0)
    assert y.shape == (2, 37, 72) and dx.shape == x.shape


def bnb_quantized_tiny_llama(bnb):
    model = tiny_model("llama", torch.bfloat16)
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or name.endswith("lm_head"):
            continue
        layer = bnb.nn.Linear4bit(module.in_features, module.out_features, bias=module.bias is not None,
                                  compute_dtype=torch.bfloat16, quant_type="nf4", compress_statistics=True)  # fmt: skip
        layer.weight = bnb.nn.Params4bit(module.weight.data, requires_grad=False, quant_type="nf4",
                                         compress_statistics=True)  # fmt: skip
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, layer)
    return model.cuda()



@pytest.mark.parametrize("precision", ["peft", "mixed"])
def test_fifty_qlora_steps_match_bitsandbytes_and_peft(bnb, precision):
    """fp32 adapters over the 4-bit base: "peft" against bitsandbytes + PEFT as they are, "mixed"
    against them under torch.autocast (the LoRA products in bf16)."""
    config = peft.LoraConfig(task_type="CAUSAL_LM", r=8, lora_alpha=16, target_modules="all-linear",
                             init_lora_weights=False)  # fmt: skip
    reference = barqtrain.get_peft_model(bnb_quantized_tiny_llama(bnb), config, ops=())
    model = copy.deepcopy(reference)
    report = patch_model(model, lora_precision=precision)
    assert report.patched_count("lora") == 14, str(report)
    expected = train_losses(reference, memorized_batch("cuda"), 50, lr=3e-3,
                            autocast=torch.bfloat16 if precision == "mixed" else None)  # fmt: skip
    losses = train_losses(model, memorized_batch("cuda"), 50, lr=3e-3)
    assert expected[-1] < 0.9 * expected[0], "bitsandbytes + PEFT did not learn"
    for step, (loss, want) in enumerate(zip(losses, expected, strict=True)):
        assert abs(loss - want) <= 1e-2 * abs(want), f"step {step}: barqtrain {loss} vs bitsandbytes+PEFT {want}"


@pytest.mark.parametrize("quant_type", ["nf4", "int8", "ternary"])
def test_barqtrain_quantized_model_trains_on_cuda_with_checkpointing(quant_type):
    model = tiny_model("llama", torch.bfloat16).cuda()
    quant.quantize_model(model, quant_type)
    model = barqtrain.get_peft_model(model, peft.LoraConfig(task_type="CAUSAL_LM", r=8, target_modules="all-linear"))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    losses = train_losses(model, memorized_batch("cuda"), 50, lr=3e-3)
    assert losses[-1] < 0.9 * losses[0]


# The largest tensors a load holds beside the quantized model, in units of the largest 16-bit
# tensor: that tensor, and for ternary (quantized with PyTorch arithmetic) its fp32 copy too.
TRANSIENT_16BIT_TENSORS = {"nf4": 1, "ternary": 3}


@pytest.mark.parametrize("quant_type", ["nf4", "ternary"])
def test_streaming_load_peaks_at_the_quantized_model_plus_one_tensors_transients(tmp_path, quant_type):
    """The whole bf16 model is ~150 MiB; its 4-bit form ~60 MiB, its ternary form ~45 MiB
    (embedding and head kept in bf16, 16 MiB each), its largest tensor 16 MiB: a load that held
    the 16-bit model fails."""
    config = transformers.LlamaConfig(vocab_size=8192, hidden_size=1024, intermediate_size=4096, num_hidden_layers=4,
                                      num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=False)  # fmt: skip
    source = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    source.save_pretrained(tmp_path)
    largest_16bit = max(p.numel() * p.element_size() for p in source.parameters())
    full_16bit = sum(p.numel() * p.element_size() for p in source.parameters())
    del source
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model = quant.load_quantized(tmp_path, quant_type, device="cuda")
    peak = torch.cuda.max_memory_allocated() - before
    quantized = torch.cuda.memory_allocated() - before
    transients = TRANSIENT_16BIT_TENSORS[quant_type]
    bound = 1.1 * (quantized + transients * largest_16bit)
    assert peak <= bound, f"peak {peak / 2**20:.1f} MiB > 1.1 x ({quant_type} model {quantized / 2**20:.1f} + " \
                          f"{transients} x the largest 16-bit tensor {largest_16bit / 2**20:.1f}) MiB"
    assert bound < full_16bit, "the model is too small for the bound to tell streaming from a full 16-bit load"
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).cuda()
    quant.quantize_model(reference, quant_type)
    ids = torch.randint(0, 8192, (2, 33), device="cuda")
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)
