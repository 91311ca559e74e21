"""`barqtrain eval`: the sliding-window perplexity of the real stories260K Llama on Shakespeare
equals the recipe of the Transformers documentation run on the unpatched model, for disjoint
and overlapping windows, and a LoRA run's perplexity is its merged model's."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
from shared_data import SHARED, require  # noqa: E402

from barqtrain.cli import main  # noqa: E402
from barqtrain.train.config import UsageError  # noqa: E402
from barqtrain.train.eval_command import evaluate  # noqa: E402
from barqtrain.train.inference import load_model  # noqa: E402

STORIES = SHARED / "models" / "stories260K-hf"
SHAKESPEARE = SHARED / "text" / "tinyshakespeare" / "input.txt"
require(STORIES / "model.safetensors", SHAKESPEARE)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("eval") / "shakespeare.txt"
    path.write_text(SHAKESPEARE.read_text()[:2500])
    return path


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32).eval()


@torch.no_grad()
def transformers_recipe(model, input_ids: list[int], context: int, stride: int) -> tuple[float, int]:
    """(summed NLL, tokens) of the Transformers documentation's fixed-length perplexity."""
    ids = torch.tensor([input_ids])
    total, count, previous_end = 0.0, 0, 0
    for begin in range(0, ids.shape[1], stride):
        end = min(begin + context, ids.shape[1])
        target_length = end - previous_end
        window = ids[:, begin:end]
        targets = window.clone()
        targets[:, :-target_length] = -100
        scored = int((targets[:, 1:] != -100).sum())  # the model shifts the labels
        total += model(window, labels=targets).loss.item() * scored
        count += scored
        previous_end = end
        if end == ids.shape[1]:
            break
    return total, count


def _sequences(path: Path, text_unit: str) -> list[dict[str, list[int]]]:
    from barqtrain.data import read_dataset

    dataset = read_dataset(path, "text", str(STORIES), text_unit=text_unit)
    return [dataset[i] for i in range(len(dataset))]


@pytest.mark.parametrize(("context", "stride"), [(128, 128), (128, 48), (96, 20)])
def test_document_perplexity_is_the_transformers_recipes(text_file, hf_model, context, stride):
    (document,) = _sequences(text_file, "document")
    assert len(document["input_ids"]) > 4 * context  # the window slides
    patched = load_model(STORIES, torch.device("cpu"), log=lambda *a: None).model
    result = evaluate(patched, [document], context, stride)
    total, count = transformers_recipe(hf_model, document["input_ids"], context, stride)
    assert result.tokens == count
    if stride < context:  # overlapping windows score every token but the first; disjoint ones not their firsts
        assert count == len(document["input_ids"]) - 1
    assert result.loss == pytest.approx(total / count, rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(total / count), rel=1e-5)


def test_line_records_sum_over_sequences(text_file, hf_model):
    sequences = _sequences(text_file, "line")
    result = evaluate(hf_model, sequences, 32, 16)
    reference = [transformers_recipe(hf_model, s["input_ids"], 32, 16) for s in sequences]
    assert result.sequences == len(sequences)
    assert result.tokens == sum(count for _, count in reference)
    assert result.loss == pytest.approx(sum(total for total, _ in reference) / result.tokens, rel=1e-5)


def test_masked_labels_are_not_scored(hf_model):
    ids = list(range(3, 43))
    labels = [-100] * 20 + ids[20:]  # a prompt of 20 tokens, then the learned part
    result = evaluate(hf_model, [{"input_ids": ids, "labels": labels}], 64, 32)
    logits = hf_model(torch.tensor([ids])).logits[0, 19:-1]
    expected = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[20:]))
    assert result.tokens == 20
    assert result.loss == pytest.approx(expected.item(), rel=1e-5)


def test_lora_run_is_scored_as_its_merged_model(tmp_path, text_file):
    """A run directory with a PEFT adapter (B not zero, so it changes the model) is evaluated
    as the adapter merged into its base."""
    import peft
    import yaml
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                      init_lora_weights=False))
    model.save_pretrained(tmp_path / "run" / "adapter")
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump({"method": "lora", "model": {"path": str(STORIES)}}))
    (document,) = _sequences(text_file, "document")
    run_model = load_model(tmp_path / "run", torch.device("cpu"), log=lambda *a: None).model
    merged = model.merge_and_unload().eval()
    result = evaluate(run_model, [document], 64, 32)
    total, count = transformers_recipe(merged, document["input_ids"], 64, 32)
    assert result.loss == pytest.approx(total / count, rel=1e-5)
    unchanged = evaluate(load_model(STORIES, torch.device("cpu"), patch=False).model, [document], 64, 32)
    assert abs(unchanged.loss - result.loss) > 1e-3


def test_cli_prints_json(text_file, capsys, hf_model):
    code = main(["eval", str(STORIES), "--data", str(text_file), "--text-unit", "document", "--context", "128",
                 "--stride", "64", "--json"])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    (document,) = _sequences(text_file, "document")
    total, count = transformers_recipe(hf_model, document["input_ids"], 128, 64)
    assert printed["tokens"] == count
    assert printed["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-5)
    assert (printed["context"], printed["stride"], printed["patched"]) == (128, 64, True)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--stride", "200", "--context", "100"], "--stride 200: must be between 1 and --context (100)"),
        (["--context", "4096"], "--context 4096: above the model's max_position_embeddings (512)"),
    ],
)
def test_window_errors_are_one_line(text_file, capsys, arguments, message):
    assert main(["eval", str(STORIES), "--data", str(text_file), *arguments]) == 2
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1


def test_missing_model_is_one_line(tmp_path, text_file):
    with pytest.raises(UsageError, match="no such run or model directory"):
        load_model(tmp_path / "nothing", torch.device("cpu"))
    (tmp_path / "empty-run").mkdir()
    with pytest.raises(UsageError, match="neither a model directory"):
        load_model(tmp_path / "empty-run", torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize(("context", "stride"), [(128, 128), (128, 48)])
def test_perplexity_on_the_gpu_with_barqtrains_kernels(text_file, hf_model, context, stride):
    """stories260K in fp32, its dtype: BarqTrain's norm and SwiGLU kernels (its attention, head_dim
    8 in fp32, is PyTorch's), against the recipe on the CPU."""
    (document,) = _sequences(text_file, "document")
    patched = load_model(STORIES, torch.device("cuda"), log=lambda *a: None).model
    result = evaluate(patched, [document], context, stride)
    total, count = transformers_recipe(hf_model, document["input_ids"], context, stride)
    assert result.tokens == count
    assert result.loss == pytest.approx(total / count, rel=1e-4)  # fp32 kernels against the CPU's fp32


@pytest.mark.gpu
def test_bf16_perplexity_on_the_gpu(tmp_path, text_file):
    """A model saved in bf16 runs in bf16 on the GPU: stories260K's perplexity is within bf16's
    rounding of the float32 recipe with the same weights (1.6e-3 relative, measured on the CPU)."""
    from transformers import AutoModelForCausalLM

    model_dir = tmp_path / "stories-bf16"
    AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.bfloat16).save_pretrained(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(STORIES / name, model_dir)
    patched = load_model(model_dir, torch.device("cuda"), log=lambda *a: None).model
    assert patched.dtype == torch.bfloat16
    (document,) = _sequences(text_file, "document")
    result = evaluate(patched, [document], 128, 48)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, count = transformers_recipe(reference, document["input_ids"], 128, 48)
    assert result.tokens == count
    assert result.loss == pytest.approx(total / count, rel=1e-2)
