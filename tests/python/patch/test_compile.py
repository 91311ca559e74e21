"""compile_decoder_layers: the decoder layers of every family's BarqTrain LoRA model trace
without a graph break on plain, packed and padded batches; compiled, they share one graph and
train as the eager model does (CPU: the ops' reference implementations, Inductor's C++ code).
The whole patched model, plain or with LoRA, compiles as one graph too, forward and backward."""

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
import transformers
from peft import LoraConfig
from tiny_models import BATCHES, FAMILIES, tiny_model

import barqtrain
from barqtrain.patch.compile import decoder_layers

LAYERS = 3
STEPS = 3


def _lora_model(checkpointing: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, use_cache=False,
    )
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    if checkpointing:
        barqtrain.enable_gradient_checkpointing(model, offload=True)
    # init_lora_weights=False: B is not zero, so the LoRA path changes the losses from the first step.
    lora = LoraConfig(task_type="CAUSAL_LM", r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    return barqtrain.get_peft_model(model, lora)


def _train(model: torch.nn.Module, ids: torch.Tensor) -> tuple[list[float], list[int]]:
    """The losses, and after each step how many graphs Dynamo has compiled."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    losses, graphs = [], []
    for _ in range(STEPS):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    return losses, graphs


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_a_patched_lora_layer_traces_as_one_graph():
    model = _lora_model(checkpointing=False)
    inner = model.get_base_model().model
    ids = torch.randint(256, (2, 16), generator=torch.Generator().manual_seed(1))
    hidden = inner.embed_tokens(ids).detach().requires_grad_()
    positions = torch.arange(16).expand(2, -1)
    rotary = inner.rotary_emb(hidden, positions)
    explanation = torch._dynamo.explain(lambda h: inner.layers[0](h, position_ids=positions, position_embeddings=rotary))(
        hidden
    )
    assert explanation.graph_break_count == 0, [reason.reason for reason in explanation.break_reasons]
    assert explanation.graph_count == 1


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "offloaded-checkpointing"])
def test_compiled_layers_train_as_the_eager_model(checkpointing):
    ids = torch.randint(256, (2, 16), generator=torch.Generator().manual_seed(1))
    eager, _ = _train(_lora_model(checkpointing), ids)

    model = _lora_model(checkpointing)
    assert barqtrain.compile_decoder_layers(model) == LAYERS
    assert all(layer._compiled_call_impl is not None for layer in decoder_layers(model))
    torch._dynamo.utils.counters.clear()
    compiled, graphs = _train(model, ids)

    # bf16: the compiled graph fuses and orders some sums differently.
    torch.testing.assert_close(compiled, eager, rtol=2e-3, atol=0)
    assert eager[-1] < eager[0]
    # The layers' parameters are graph inputs, so the layers share graphs: at most one for the
    # first layer (its input needs no gradient) and one for the others; none compiled again
    # after the first step.
    assert graphs[0] <= 2 and graphs == [graphs[0]] * STEPS
    assert not torch._dynamo.utils.counters["graph_break"]


def test_a_model_without_decoder_layers_is_named():
    with pytest.raises(ValueError, match="Linear has no decoder layers"):
        barqtrain.compile_decoder_layers(torch.nn.Linear(2, 2))


# Every family on packed rows (position_ids restarting per sequence, the layouts' hardest
# case); plain and padded rows on a family without and one with sliding windows and softcaps.
TRACED_CASES = [(family, "packed") for family in sorted(FAMILIES)] + [
    (family, batch) for family in ("llama", "gemma2") for batch in sorted(set(BATCHES) - {"packed"})
]


@pytest.mark.parametrize(("family", "batch_name"), TRACED_CASES)
def test_every_family_lora_layer_traces_without_a_graph_break(family, batch_name):
    """fullgraph=True fails on any graph break. The counting backend runs the traced graph as
    is (no code generation), so in float32 the traced layers give the eager model's loss and
    gradients bit for bit: what the trace captured is what eager Python computes. (In bf16 the
    whole-layer trace rounds the residual stream's gradient once more than the fused eager op.)"""
    batch = BATCHES[batch_name]()

    def lora_model() -> torch.nn.Module:
        model = tiny_model(family, torch.float32)
        lora = LoraConfig(task_type="CAUSAL_LM", r=4, target_modules="all-linear", init_lora_weights=False)
        return barqtrain.get_peft_model(model, lora)

    def loss_and_gradients(model: torch.nn.Module) -> list[torch.Tensor]:
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        return [loss.detach()] + [p.grad for p in model.parameters() if p.requires_grad]

    expected = loss_and_gradients(lora_model())
    model = lora_model()
    counter = torch._dynamo.testing.CompileCounter()
    barqtrain.compile_decoder_layers(model, backend=counter, fullgraph=True)
    traced = loss_and_gradients(model)
    assert counter.frame_count >= 1
    for mine, theirs in zip(traced, expected, strict=True):
        assert torch.equal(mine, theirs)


def _loss_and_gradients(model: torch.nn.Module, batch: dict) -> list[torch.Tensor]:
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    gradients = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    return [loss.detach(), *gradients]


def _check_one_graph(make_model, batch: dict) -> None:
    """make_model() compiled with fullgraph (aot_eager runs the traced forward and backward
    graphs as they are) computes the eager model's loss and gradients in float32, and a second
    step of the same shapes compiles nothing new."""
    expected = _loss_and_gradients(make_model(), batch)
    model = make_model()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    model.compile(backend=counter, fullgraph=True)
    compiled = _loss_and_gradients(model, batch)
    assert counter.frame_count == 1
    torch.testing.assert_close(compiled, expected, rtol=1e-5, atol=1e-6)
    _loss_and_gradients(model, batch)
    assert counter.frame_count == 1


# Every family, plain and LoRA, on packed rows; plain and padded rows on a family without and
# one with sliding windows and softcaps.
WHOLE_MODEL_CASES = [(family, "packed", lora) for family in sorted(FAMILIES) for lora in (False, True)] + [
    (family, batch, True) for family in ("llama", "gemma2") for batch in sorted(set(BATCHES) - {"packed"})
]


@pytest.mark.parametrize(("family", "batch_name", "lora"), WHOLE_MODEL_CASES)
def test_every_family_compiles_as_one_graph(family, batch_name, lora):
    """torch.compile(model, fullgraph=True) fails on any graph break; AOTAutograd traces the
    backward too."""
    batch = BATCHES[batch_name]()

    def patched_model() -> torch.nn.Module:
        model = tiny_model(family, torch.float32)
        if not lora:
            barqtrain.patch_model(model)
            return model
        config = LoraConfig(task_type="CAUSAL_LM", r=4, target_modules="all-linear", init_lora_weights=False)
        return barqtrain.get_peft_model(model, config)

    _check_one_graph(patched_model, batch)


@pytest.mark.parametrize("quant_type", ["nf4", "int8", "ternary"])
def test_a_qlora_model_compiles_as_one_graph(quant_type):
    """QLoRA: the fused dequant-GEMM ops of the quantized base inside the one graph (the layers'
    QuantizedWeight is built before tracing), forward and backward; loss and LoRA gradients as
    the eager model's, and no recompilation on the next step."""
    from barqtrain.quant import quantize_model

    batch = BATCHES["packed"]()

    def qlora_model() -> torch.nn.Module:
        model = tiny_model("llama", torch.float32)  # the reference ops compute in float32
        quantize_model(model, quant_type)
        config = LoraConfig(task_type="CAUSAL_LM", r=4, target_modules="all-linear", init_lora_weights=False)
        return barqtrain.get_peft_model(model, config)

    _check_one_graph(qlora_model, batch)
