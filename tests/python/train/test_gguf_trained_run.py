"""The README's path after training, on a real run: `barqtrain train` (LoRA on stories260K and
Shakespeare) -> `eval` -> `generate` -> `export --gguf`, and llama.cpp gives the merged
model's logits."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf_models import STORIES, llama_cpp_or_skip  # noqa: E402
from shared_data import SHARED, require  # noqa: E402

from barqtrain.cli import main  # noqa: E402

llama_cpp = llama_cpp_or_skip()
SHAKESPEARE = SHARED / "text" / "tinyshakespeare" / "input.txt"
require(STORIES / "model.safetensors", SHAKESPEARE)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("after-training")
    lines = [line for line in SHAKESPEARE.read_text().splitlines() if line.strip()][:150]
    (root / "train.txt").write_text("\n".join(lines) + "\n")
    config = {
        "model": {"path": str(STORIES)},
        "data": {"path": str(root / "train.txt"), "format": "text", "seq_length": 128, "eval_split": 0.1},
        "method": "lora",
        "lora": {"r": 8, "alpha": 16.0, "dropout": 0.0, "target_modules": "all-linear"},
        "optim": {"name": "adamw", "lr": 0.003, "warmup_steps": 0, "schedule": "constant"},
        "batch_size": 4, "steps": 4, "eval_interval": 2, "output_dir": str(root / "run"), "plot": False,
    }
    (root / "run.yaml").write_text(yaml.safe_dump(config))
    assert main(["train", str(root / "run.yaml")]) == 0
    return root / "run"


def test_train_eval_generate_export(run, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval_loss" in r]
    assert evals and all(r["eval_perplexity"] == pytest.approx(np.exp(r["eval_loss"])) for r in evals)
    capsys.readouterr()

    data = run.parent / "train.txt"
    assert main(["eval", str(run), "--data", str(data), "--json"]) == 0
    evaluation = json.loads(capsys.readouterr().out)
    assert evaluation["perplexity"] == pytest.approx(np.exp(evaluation["loss"]))
    assert main(["generate", str(run), "--prompt", "First Citizen:", "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out.strip()

    assert main(["export", str(run), "--out", str(run.parent / "merged")]) == 0
    assert main(["export", str(run), "--gguf", "f16"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(run.parent / "merged", dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(run.parent / "merged")("First Citizen: we are").input_ids
    with torch.no_grad():
        expected = merged(torch.tensor([ids])).logits[0].numpy()
    model = llama_cpp.Llama(model_path=str(run / "model-f16.gguf"), n_ctx=64, logits_all=True, verbose=False,
                            n_threads=2)
    try:
        assert model.tokenize("First Citizen: we are".encode(), add_bos=True, special=False) == ids
        model.eval(ids)
        got = np.array(model.scores[: len(ids)])
    finally:
        model.close()
    assert np.abs(got - expected).max() / np.abs(expected).max() < 5e-3  # the f16 bound of test_gguf_llama_cpp
