"""The core of benchmarks/convergence.py on a short run: 20 LoRA steps of the real stories260K
checkpoint on real instruction data, HF+PEFT (fp32 adapters) against BarqTrain
lora_precision="mixed" from one seed; the losses match at every step within SPEC's bf16 bar
(1e-2 relative). The full study (200 steps, three seeds, families, QLoRA) is
docs/convergence.md."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
from shared_data import require  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "benchmarks" / "convergence.py"


def load_study():
    spec = importlib.util.spec_from_file_location("convergence_study", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


study = load_study()

require(study.MODEL_DIR / "model.safetensors", study.DATA_FILE)


@pytest.fixture(scope="module")
def settings_and_data():
    settings = study.Settings(steps=20, eval_every=20, eval_rows=8, threads=2)
    return settings, study.prepare_data(settings)


def test_packed_rows_mask_the_prompts(settings_and_data):
    settings, data = settings_and_data
    ids, labels = data["train_ids"], data["train_labels"]
    assert ids.shape[1] == settings.seq_len and ids.shape == labels.shape
    kept = labels != -100
    assert (labels[kept] == ids[kept]).all()  # labels are the inputs, the prompts masked
    assert 0.3 < kept.float().mean() < 0.99
    assert data["stats"]["eval_examples"] >= 1 and data["eval_ids"].shape[0] == settings.eval_rows


def test_barqtrain_mixed_matches_hf_peft_per_step_within_bf16_tolerance(settings_and_data):
    settings, data = settings_and_data
    hf = study.train(study.RunSpec("llama", "hf", seed=0), settings, data)
    barq = study.train(study.RunSpec("llama", "barq_mixed", seed=0), settings, data)
    assert hf.lora_layers == barq.lora_layers == 35
    assert len(hf.losses) == len(barq.losses) == settings.steps
    diffs = study.rel_diffs(barq.losses, hf.losses)
    assert max(diffs) < 1e-2, [f"{d:.2e}" for d in diffs]
    # it learns: held-out loss falls, the same for both
    assert hf.evals[settings.steps] < 0.95 * hf.evals[0]
    assert abs(barq.evals[settings.steps] - hf.evals[settings.steps]) < 1e-2 * hf.evals[settings.steps]
