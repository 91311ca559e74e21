"""The trainer's YAML config: validated on load, errors name the key path."""

import pytest
import yaml

from barqtrain import cli
from barqtrain.train.config import (
    TEMPLATES,
    ConfigError,
    TrainConfig,
    config_from_dict,
    load_config,
    template,
    template_yaml,
)


@pytest.mark.parametrize(
    "mapping, message",
    [
        ({"optim": {"lr": "fast"}}, "optim.lr: expected a number, got 'fast'"),
        ({"optim": {"lrr": 1e-3}}, "optim.lrr: unknown key"),
        ({"bogus": 1}, "bogus: unknown key"),
        ({"batch_size": 2.5}, "batch_size: expected an integer, got 2.5"),
        (
            {"gradient_checkpointing": "yes"},
            "gradient_checkpointing: expected true or false or one of 'offload', 'auto', got 'yes'",
        ),
        ({"method": "dora"}, "method: expected one of 'lora', 'qlora', 'full'"),
        ({"qlora": {"quant_type": "int4"}},
         "qlora.quant_type: expected one of 'nf4', 'fp4', 'int8', 'ternary', got 'int4'"),
        ({"qlora": {"quant_type": "int8", "double_quant": False}}, "qlora.double_quant: applies to nf4/fp4 only"),
        ({"qlora": {"quant_type": "ternary", "double_quant": False}}, "qlora.double_quant: applies to nf4/fp4 only"),
        ({"qlora": {"group_size": 64}}, "qlora.group_size: applies to quant_type ternary only"),
        ({"qlora": {"quant_type": "ternary", "group_size": 48}},
         "qlora.group_size: applies to quant_type ternary only, a positive multiple of 32"),
        ({"qlora": {"blocksize": 128}},
         "qlora.blocksize: unknown key; expected one of double_quant, group_size, quant_type"),
        ({"lora": {"target_modules": [1]}}, "lora.target_modules"),
        ({"lora": 3}, "lora: expected a mapping"),
        ({"batch_size": 0}, "batch_size: must be at least 1"),
        ({"model": {"name": "huge"}}, "model.name: unknown named config 'huge'; choose from tiny-llama, llama-1b-shape, llama-8b-shape"),
        ({"data": {"seq_length": 10}}, "data.seq_length: the built-in task's sequences are 14 tokens; got 10"),
        ({"data": {"seq_length": 28, "packing": False}}, "data.seq_length: without packing, the built-in task's rows are its 14-token"),
        ({"data": {"eval_split": 1.0}}, "data.eval_split: must be at least 0 and below 1, got 1.0"),
        ({"data": {"format": "csv"}}, "data.format: expected one of 'text', 'alpaca', 'messages'"),
        ({"data": {"path": "x.jsonl"}}, "data.tokenizer: a dataset file needs a tokenizer"),
        ({"optim": {"name": "lion"}}, "optim.name: expected one of 'adamw', 'adamw_8bit'"),
    ],
)
def test_bad_configs_name_the_key(mapping, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        config_from_dict(mapping)


def test_empty_config_is_the_embedded_default(tmp_path):
    assert load_config() == TrainConfig()
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_config(path) == TrainConfig()


def test_yaml_scientific_notation_and_lists():
    config = config_from_dict({"optim": {"lr": "1e-4"}, "lora": {"target_modules": ["q_proj", "v_proj"]}})
    assert config.optim.lr == 1e-4 and config.lora.target_modules == ["q_proj", "v_proj"]


@pytest.mark.parametrize("name", TEMPLATES)
@pytest.mark.parametrize("documented", [False, True])
def test_templates_load_back(name, documented):
    text = template_yaml(name, documented=documented)
    assert config_from_dict(yaml.safe_load(text)) == template(name)
    assert ("# peak learning rate" in text) == documented


def test_templates_say_what_they_are_for():
    assert template("default") == TrainConfig()  # the embedded default, as YAML
    lora, qlora, full, long = template("lora"), template("qlora"), template("full"), template("long-context")
    assert lora.method == "lora" and full.method == "full" and long.method == "lora"
    assert qlora.method == "qlora" and qlora.gradient_checkpointing and qlora.lora == lora.lora
    assert (qlora.qlora.quant_type, qlora.qlora.double_quant) == ("nf4", True)  # QLoRA's NF4 with double quantization
    assert long.data.seq_length >= 32768 and long.gradient_checkpointing and long.data.packing
    for config in (lora, qlora, full, long):
        assert config.model.path and config.data.path and config.steps is None and config.data.eval_split > 0
    assert "Set model.path to your Hugging Face model directory" in template_yaml("lora")


def test_the_fsdp_template_says_how_to_launch_it(capsys):
    assert cli.main(["config", "--template", "fsdp"]) == 0
    text = capsys.readouterr().out
    assert "torchrun --nproc-per-node N -m barqtrain.cli train THIS_FILE.yaml" in text and "batch_size is per GPU" in text
    fsdp = config_from_dict(yaml.safe_load(text))
    assert fsdp == template("fsdp") and fsdp.method == "lora" and fsdp.model.path and fsdp.data.path


def test_unknown_template(capsys):
    assert cli.main(["config", "--template", "huge"]) == 2
    assert "unknown template 'huge'; choose from default, lora, qlora, full, long-context, fsdp" in capsys.readouterr().err


def test_config_command_writes_a_template(tmp_path, capsys):
    out = tmp_path / "lora.yaml"
    assert cli.main(["config", "--template", "lora", "--documented", "--out", str(out)]) == 0
    assert load_config(out).method == "lora"


def test_train_command_rejects_a_bad_config(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("optim:\n  lr: fast\n")
    assert cli.main(["train", str(path)]) == 2
    assert "optim.lr: expected a number, got 'fast'" in capsys.readouterr().err


def test_the_readme_quick_start_config_is_the_lora_template():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    block = readme.split("```yaml\n", 1)[1].split("```", 1)[0]
    shown = yaml.safe_load(block)
    config = config_from_dict(shown)  # valid as it stands

    def same(mapping, expected, path=""):
        for key, value in mapping.items():
            if isinstance(value, dict):
                same(value, getattr(expected, key), f"{path}{key}.")
            else:
                assert getattr(expected, key) == value, f"README sets {path}{key}: {value!r}; the lora template has {getattr(expected, key)!r}"

    same(shown, template("lora"))
    assert config.method == "lora"


@pytest.mark.parametrize("text, value", [("true", True), ("false", False), ("offload", "offload")])
def test_gradient_checkpointing_is_true_false_or_offload(tmp_path, text, value):
    path = tmp_path / "config.yaml"
    path.write_text(f"gradient_checkpointing: {text}\n")
    assert load_config(path).gradient_checkpointing == value
