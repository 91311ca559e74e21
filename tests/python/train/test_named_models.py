"""Named random-init models (model.name) and the built-in task in rows of real length: the
1B-shape run of the GPU check's train phase, checked on a CPU without training it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from barqtrain.train import shapes, task
from barqtrain.train.batches import TaskData
from barqtrain.train.config import NAMED_MODELS, config_from_dict, to_dict

GPU_CHECK = Path(__file__).resolve().parents[3] / "scripts" / "gpu_check.sh"


def gpu_check_config() -> dict:
    """The 1B-shape config that scripts/gpu_check.sh writes for its train phase."""
    script = GPU_CHECK.read_text()
    return yaml.safe_load(script.split("<<'LLAMA_1B_SHAPE_RUN'\n", 1)[1].split("\nLLAMA_1B_SHAPE_RUN\n", 1)[0])


def parameters_on_meta(config: dict) -> int:
    from transformers import AutoModelForCausalLM, LlamaConfig

    with torch.device("meta"):  # shapes only: no memory, no init
        model = AutoModelForCausalLM.from_config(LlamaConfig(**config))
    return sum(p.numel() for p in model.parameters())


def test_named_shapes_are_the_published_llama_shapes():
    assert NAMED_MODELS["llama-1b-shape"] == shapes.LLAMA_3_2_1B
    assert NAMED_MODELS["llama-8b-shape"] == shapes.LLAMA_3_1_8B
    # Llama-3.2-1B (tied embeddings) and Llama-3.1-8B as published.
    assert parameters_on_meta(NAMED_MODELS["llama-1b-shape"]) == 1_235_814_400
    assert parameters_on_meta(NAMED_MODELS["llama-8b-shape"]) == 8_030_261_248


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_the_gpu_check_1b_config_loads_and_round_trips(method):
    mapping = {**gpu_check_config(), "method": method}  # the script appends `method: qlora` for its second run
    config = config_from_dict(mapping)
    assert (config.model.name, config.method, config.data.path, config.data.seq_length) == (
        "llama-1b-shape", method, None, 2048
    )
    assert (config.batch_size, config.steps, config.lora.r) == (4, 30, 16)
    assert config_from_dict(yaml.safe_load(yaml.safe_dump(to_dict(config)))) == config


def test_the_task_packs_rows_of_data_seq_length():
    config = config_from_dict(gpu_check_config())
    batch = TaskData(config).next()
    per_row = 2048 // task.SEQUENCE_LENGTH  # 146 sequences, then 4 tokens of padding
    assert batch["input_ids"].shape == batch["labels"].shape == batch["position_ids"].shape == (4, 2048)
    positions = batch["position_ids"][0]
    assert (positions[: per_row * task.SEQUENCE_LENGTH].reshape(per_row, -1) == torch.arange(task.SEQUENCE_LENGTH)).all()
    assert positions[-4:].tolist() == [0, 1, 2, 3]
    assert (batch["labels"][:, -4:] == task.IGNORE_INDEX).all()
    assert "146 sequences packed per row" in TaskData(config).describe()


def test_packed_task_rows_compute_the_loss_of_their_sequences():
    """No token attends across a packed sequence's boundary: a row's loss is its sequences' loss."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**task.TINY_LLAMA)).eval()
    rows = task.make_packed_rows(2, 3 * task.SEQUENCE_LENGTH + 5, torch.Generator().manual_seed(3))
    input_ids, labels = task.make_batch(6, torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(**rows).loss, model(input_ids=input_ids, labels=labels).loss)
