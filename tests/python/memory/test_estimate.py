"""barqtrain.memory.estimate on a CPU: parameter, adapter, quantized-weight and optimizer-state
bytes exactly as the real modules hold them, and the tensors each decoder layer keeps for the
backward pass exactly as autograd saves them in a forward pass of a patched model (summed per
module with torch.autograd.graph.saved_tensors_hooks, each storage counted once)."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import barqtrain
import peft
import pytest
import torch
import transformers
from barqtrain.cli import main
from barqtrain.memory import set_attention_tile_tokens, set_mlp_tile_tokens
from barqtrain.memory.estimator import (
    GIB,
    ModelShape,
    RunShape,
    adapter_parameters,
    estimate,
    layer_activations,
    log_estimate,
    loss_activations,
    optimizer_state_bytes,
    quantized_bytes,
    run_shape,
    trainable_tensors,
    weight_bytes,
)
from barqtrain.quant import quantize_model
from barqtrain.quant.linear import QUANTIZED_LINEAR_TYPES
from barqtrain.train.config import NAMED_MODELS, ConfigError, config_from_dict, to_dict
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "patch"))
from tiny_models import tiny_model  # noqa: E402

BATCH, SEQ = 2, 16


def _config(**overrides):
    return config_from_dict({"model": {"name": "tiny-llama"}, **overrides})


# ------------------------------------------------------------------------ parameters and states


@pytest.mark.parametrize("name", ["llama-1b-shape", "llama-8b-shape"])
def test_parameter_count_of_the_named_shapes_is_the_meta_models(name):
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**NAMED_MODELS[name]))
    shape = ModelShape.from_hf_config(model.config)
    assert shape.parameter_count() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_parameter_count_of_each_family_with_its_biases_and_norms(family):
    model = tiny_model(family)
    assert ModelShape.from_hf_config(model.config).parameter_count() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj"], ["gate_proj", "down_proj", "o_proj"]])
def test_adapter_parameters_are_pefts(targets):
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**NAMED_MODELS["llama-1b-shape"]))
    config = config_from_dict({"model": {"name": "llama-1b-shape"}, "lora": {"r": 16, "target_modules": targets}})
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, target_modules=targets, task_type="CAUSAL_LM"))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert adapter_parameters(ModelShape.from_hf_config(model.config), run_shape(config)) == trainable


@pytest.mark.parametrize("method", ["lora", "full"])
def test_adamw_states_are_the_optimizers_after_a_step(method):
    model = tiny_model("llama")
    config = _config(method=method, lora={"r": 4}, precision="fp32")
    if method == "lora":
        model = barqtrain.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, foreach=True)
    ids = torch.randint(model.config.vocab_size, (BATCH, SEQ))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    states = sum(state[key].nbytes for state in optimizer.state.values() for key in ("exp_avg", "exp_avg_sq"))
    tensors = trainable_tensors(ModelShape.from_hf_config(model.config), run_shape(config))
    assert sorted(tensors) == sorted(p.numel() for p in trainable)
    assert optimizer_state_bytes(config, tensors)[0] == states


def _allocated(nbytes: int) -> int:
    return max(512, -(-nbytes // 512) * 512)


@pytest.mark.parametrize(
    "quant_type, double_quant", [("nf4", True), ("nf4", False), ("fp4", True), ("int8", True), ("ternary", True)]
)
@pytest.mark.parametrize("intermediate", [128, 172])  # 172: gate, up and down stay 16-bit (shapes)
def test_quantized_weights_are_what_quantize_model_keeps(quant_type, double_quant, intermediate):
    model = tiny_model("llama", dtype=torch.bfloat16, intermediate_size=intermediate)
    quantize_model(model, quant_type, double_quant)
    quantized = {name for name, module in model.named_modules() if isinstance(module, QUANTIZED_LINEAR_TYPES)}
    # The 16-bit parameters and the quantized layers' tensors (codes and quantization state,
    # frozen parameters and buffers, each its own allocation); not the rotary embedding's
    # frequencies, which are no weights.
    def in_quantized(name: str) -> bool:
        return name.rpartition(".")[0] in quantized

    held = sum(p.nbytes for name, p in model.named_parameters() if not in_quantized(name))
    quantized_tensors = [t for name, t in [*model.named_parameters(), *model.named_buffers()] if in_quantized(name)]
    held += sum(_allocated(t.nbytes) for t in quantized_tensors)
    config = _config(method="qlora", precision="bf16", qlora={"quant_type": quant_type, "double_quant": double_quant})
    assert weight_bytes(ModelShape.from_hf_config(model.config), config)[0] == held


def test_8bit_adamw_states_follow_bitsandbytes_blocks():
    config = _config(optim={"name": "adamw_8bit"})
    # Tensors under 4096 elements keep fp32 states; larger ones a byte an element and an fp32
    # absmax per block of 256.
    assert optimizer_state_bytes(config, [100, 65536])[0] == 2 * 4 * 100 + 2 * (65536 + 4 * 256)
    assert quantized_bytes(64, 64, "int8", True) == _allocated(64 * 64) + _allocated(4 * 64)


# ------------------------------------------------------------------------ kept activations


class SavedBytes:
    """The bytes autograd saves during a forward pass, per module of the estimate's accounting,
    each storage counted once (where first saved) and the model's parameters and buffers left
    out. Decoder-layer modules are told apart by forward hooks; the post-attention RMSNorm is not
    hooked (a hook would make the patched layer call it instead of its fused add + RMSNorm)."""

    def __init__(self, model: nn.Module) -> None:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.excluded = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        self.seen: set[int] = set()
        self.bytes: dict[str, int] = defaultdict(int)
        self.stack = ["loss"]  # outside every hooked module: the causal-LM head's loss
        self.rope_tables: set[int] = set()
        layers = base.model.layers
        for index, layer in enumerate(layers):
            self._hook(layer, f"{index}.decoder_layer")
            for name in ("input_layernorm", "self_attn", "mlp"):
                self._hook(getattr(layer, name), f"{index}.{name}")
        self._hook(base.model.norm, "norm")
        base.model.rotary_emb.register_forward_hook(self._remember_rope_tables)

    def _hook(self, module: nn.Module, name: str) -> None:
        module.register_forward_pre_hook(lambda *_: self.stack.append(name))
        module.register_forward_hook(lambda *_: self.stack.pop() and None)

    def _remember_rope_tables(self, module, args, output) -> None:
        self.rope_tables |= {t.untyped_storage().data_ptr() for t in output}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in self.excluded and pointer not in self.seen:
            self.seen.add(pointer)
            self.bytes["rope" if pointer in self.rope_tables else self.stack[-1]] += storage.nbytes()
        return tensor


def _saved_bytes(model: nn.Module) -> dict[str, int]:
    counter = SavedBytes(model)
    ids = torch.randint(model.config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    position_ids = torch.arange(SEQ).expand(BATCH, SEQ)
    # The batch itself (the embedding keeps input_ids where its weight trains) is the estimate's
    # "batch", alive whether saved or not.
    counter.excluded |= {ids.untyped_storage().data_ptr(), position_ids.untyped_storage().data_ptr()}
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda tensor: tensor):
        loss = model(input_ids=ids, labels=ids, position_ids=position_ids).loss
    loss.backward()  # outside the hooks: what a backward pass saves (a tiled MLP's tiles) is not kept
    return dict(counter.bytes)


def _estimated_bytes(model: nn.Module, run: RunShape) -> dict[str, int]:
    shape = ModelShape.from_hf_config(model.config)
    expected: dict[str, int] = defaultdict(int)
    for index in range(shape.layers):
        for kept in layer_activations(shape, run, first=index == 0):
            expected[f"{index}.{kept.module}"] += kept.bytes
    for kept in loss_activations(shape, run):
        if kept.module != "batch":  # the inputs: alive, not saved by autograd
            expected[kept.module] += kept.bytes
    return {key: value for key, value in expected.items() if value}


def _bf16_lora_run(ranks: dict[str, int], dropout: bool, product_bytes: int) -> RunShape:
    return RunShape(
        batch=BATCH, seq=SEQ, method="lora", policy="off", residual_bytes=2, compute_bytes=2,
        lora_product_bytes=product_bytes, lora_ranks=ranks, lora_dropout=dropout,
    )


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize(
    "targets, dropout, precision",
    [
        ("all-linear", 0.0, "mixed"),
        (["q_proj", "v_proj", "down_proj"], 0.1, "mixed"),
        ("all-linear", 0.0, "peft"),
    ],
)
def test_lora_layers_keep_what_the_estimate_counts(family, targets, dropout, precision):
    model = tiny_model(family, dtype=torch.bfloat16, use_sliding_window=False)
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=targets, task_type="CAUSAL_LM")
    model = barqtrain.get_peft_model(model, lora, lora_precision=precision).train()
    names = [p for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
             if targets == "all-linear" or p in targets]  # fmt: skip
    run = _bf16_lora_run({name: 4 for name in names}, dropout > 0, 4 if precision == "peft" else 2)
    assert _saved_bytes(model) == _estimated_bytes(model, run)


def test_full_fine_tuning_layers_keep_what_the_estimate_counts():
    model = tiny_model("llama").train()  # fp32: on a CPU the trainer does not autocast
    barqtrain.patch_model(model)
    run = RunShape(
        batch=BATCH, seq=SEQ, method="full", policy="off", residual_bytes=4, compute_bytes=4, lora_product_bytes=4,
        lora_ranks={}, lora_dropout=False,
    )
    assert _saved_bytes(model) == _estimated_bytes(model, run)


@pytest.mark.parametrize("method", ["lora", "lora-attention", "full"])
def test_tiled_mlps_keep_what_the_estimate_counts(method):
    """A tiled MLP keeps its input alone: the patched model's saved tensors, per module."""
    dtype = torch.float32 if method == "full" else torch.bfloat16
    model = tiny_model("llama", dtype=dtype)
    names = ("q_proj", "v_proj") if method == "lora-attention" else ()
    if method == "full":
        barqtrain.patch_model(model)
    else:
        targets = list(names) or "all-linear"
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, task_type="CAUSAL_LM")
        model = barqtrain.get_peft_model(model, lora)
        names = names or ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    set_mlp_tile_tokens(model, 5)  # 32 rows: 7 tiles
    bytes_ = 4 if method == "full" else 2
    run = RunShape(
        batch=BATCH, seq=SEQ, method="full" if method == "full" else "lora", policy="off", residual_bytes=bytes_,
        compute_bytes=bytes_, lora_product_bytes=bytes_, lora_ranks={name: 4 for name in names}, lora_dropout=False,
        mlp_tile_tokens=5,
    )
    assert _saved_bytes(model.train()) == _estimated_bytes(model, run)


@pytest.mark.parametrize(("family", "method"), [("llama", "lora"), ("qwen3", "lora"), ("llama", "full")])
def test_tiled_attention_keeps_what_the_estimate_counts(family, method):
    """Attention tiled by queries keeps its input, k and v (k before its norm too) and k's RoPE
    tables; q and everything after it are made again per tile."""
    dtype = torch.float32 if method == "full" else torch.bfloat16
    model = tiny_model(family, dtype=dtype, use_sliding_window=False)
    ops = (*barqtrain.patch.OPS, "attention")
    if method == "full":
        barqtrain.patch_model(model, ops=ops)
        ranks = {}
    else:
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
        model = barqtrain.get_peft_model(model, lora, ops=ops)
        ranks = {name: 4 for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}
    set_attention_tile_tokens(model, 5)  # 32 rows: 7 tiles
    bytes_ = 4 if method == "full" else 2
    run = RunShape(
        batch=BATCH, seq=SEQ, method=method, policy="off", residual_bytes=bytes_, compute_bytes=bytes_,
        lora_product_bytes=bytes_, lora_ranks=ranks, lora_dropout=False, attention_tile_tokens=5,
    )
    assert _saved_bytes(model.train()) == _estimated_bytes(model, run)


def test_tiled_attention_lowers_the_peak_and_adds_its_forward_to_the_step():
    config = {"model": {"name": "llama-8b-shape"}, "method": "qlora", "batch_size": 1, "data": {"seq_length": 131072},
              "gradient_checkpointing": True, "memory": {"mlp_tile_tokens": 8192}}  # fmt: skip
    untiled = estimate(config_from_dict(config))
    tiled = estimate(config_from_dict({**config, "memory": {"mlp_tile_tokens": 8192, "attention_tile_tokens": 8192}}))
    # More than the untiled backward's fp32 dq accumulator: two [tokens x hidden] 16-bit tensors' worth.
    assert tiled.peak_bytes < untiled.peak_bytes - 2 * 131072 * 4096 * 2
    assert untiled.step_seconds < tiled.step_seconds < 1.5 * untiled.step_seconds
    assert "attention in tiles of 8192 queries" in tiled.table().splitlines()[0]


# ------------------------------------------------------------------------ the estimate


def test_checkpointing_keeps_less_and_offloading_least_and_pins_the_inputs():
    peaks = {}
    for policy in (False, True, "offload"):
        config = config_from_dict(
            {"model": {"name": "llama-8b-shape"}, "data": {"seq_length": 8192}, "batch_size": 1,
             "gradient_checkpointing": policy}  # fmt: skip
        )
        peaks[policy] = estimate(config)
    assert peaks[False].peak_bytes > peaks[True].peak_bytes > peaks["offload"].peak_bytes
    assert peaks[True].pinned_host_bytes == 0
    # Each of the 32 layers' inputs: 8192 tokens x 4096 bf16 values.
    assert peaks["offload"].pinned_host_bytes == 32 * 8192 * 4096 * 2
    assert peaks[True].step_seconds > peaks[False].step_seconds  # the recompute


def test_components_add_up_and_the_table_and_json_say_them(capsys):
    config = config_from_dict({"model": {"name": "llama-1b-shape"}, "data": {"seq_length": 2048}, "batch_size": 4})
    result = estimate(config)
    assert sum(c.bytes for c in result.components) == result.peak_bytes
    table = result.table()
    assert "weights" in table and f"{result.peak_bytes / GIB:8.3f}" in table
    as_json = json.loads(result.to_json())
    assert as_json["peak_gib"] == pytest.approx(result.peak_bytes / GIB)
    assert {c["name"] for c in as_json["components"]} == {c.name for c in result.components}


def test_estimate_command_prints_the_table_and_json(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("model: {name: llama-1b-shape}\ndata: {seq_length: 4096}\nbatch_size: 2\nmethod: qlora\n")
    assert main(["estimate", str(path)]) == 0
    assert "peak GPU memory" in capsys.readouterr().out
    assert main(["estimate", str(path), "--json", "--seq-length", "8192"]) == 0
    assert json.loads(capsys.readouterr().out)["run"]["seq"] == 8192


def test_estimate_command_names_what_it_cannot_estimate(tmp_path, capsys):
    model_dir = tmp_path / "gemma"
    model_dir.mkdir()
    transformers.GemmaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=32, vocab_size=128).save_pretrained(model_dir)  # fmt: skip
    path = tmp_path / "run.yaml"
    path.write_text(f"model: {{path: {model_dir}}}\ndata: {{path: {tmp_path / 'data.jsonl'}}}\n")
    assert main(["estimate", str(path)]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("barqtrain estimate: model.path: model_type 'gemma'") and len(error.splitlines()) == 1
    with pytest.raises(ConfigError, match=r"lora.target_modules: 'lm_head'"):
        estimate(_config(lora={"target_modules": ["q_proj", "lm_head"]}))
    with pytest.raises(ConfigError, match=r"^model.patch: false trains with Hugging Face's"):
        estimate(_config(model={"name": "tiny-llama", "patch": False}))
    with pytest.raises(ConfigError, match=r"^model.compile: regional: torch.compile's graphs"):
        estimate(_config(model={"name": "tiny-llama", "compile": "regional"}))


def test_train_logs_one_line_or_says_why_there_is_no_estimate(tmp_path):
    logged = []
    log_estimate(config_from_dict({"model": {"name": "llama-1b-shape"}, "data": {"seq_length": 2048}}), logged.append)
    assert len(logged) == 1 and logged[0].startswith("Estimate (`barqtrain estimate` for all of it): peak ")
    model_dir = tmp_path / "gemma"
    transformers.GemmaConfig(num_hidden_layers=1, vocab_size=128).save_pretrained(model_dir)
    logged.clear()
    log_estimate(config_from_dict({"model": {"path": str(model_dir)}, "data": {"tokenizer": str(model_dir)}}), logged.append)
    assert logged == ["No memory estimate: model.path: model_type 'gemma' is not one `barqtrain estimate` models (it "
                      "models the decoder layers of llama, mistral, qwen2, qwen3)."]  # fmt: skip


def test_offloading_more_than_the_host_can_pin_is_a_warning(monkeypatch):
    config = config_from_dict(
        {"model": {"name": "llama-8b-shape"}, "data": {"seq_length": 65536}, "batch_size": 1,
         "gradient_checkpointing": "offload"}  # fmt: skip
    )
    monkeypatch.setattr("barqtrain.memory.estimator.host_memory_bytes", lambda: 16 * GIB)  # 16 GiB of inputs
    result = estimate(config)
    assert result.pinned_exceeds_host() and "Warning: the offloaded layer inputs need more pinned" in result.table()
    monkeypatch.setattr("barqtrain.memory.estimator.host_memory_bytes", lambda: 128 * GIB)
    assert not estimate(config).pinned_exceeds_host()
    # memory.host_gib: the host planned for, not this machine.
    monkeypatch.setattr("barqtrain.memory.estimator.host_memory_bytes", lambda: 16 * GIB)
    other_host = config_from_dict({**to_dict(config), "memory": {"host_gib": 128.0}})
    assert not estimate(other_host).pinned_exceeds_host()
    assert estimate(other_host).to_dict()["host_memory_gib"] == 128.0
    with pytest.raises(ConfigError, match=r"^memory.host_gib: GiB of host RAM, must be positive"):
        config_from_dict({"memory": {"host_gib": 0}})
