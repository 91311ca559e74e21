"""`barqtrain demo`: what `make run` shows without a GPU must actually learn."""

import torch

from barqtrain import cli
from barqtrain.demo import IGNORE_INDEX, make_batch, train_demo


def test_batches_score_only_the_repeated_digits():
    input_ids, labels = make_batch(3, torch.Generator().manual_seed(0))
    prompt_digits, answer = input_ids[:, 1:7], input_ids[:, 8:]
    assert torch.equal(prompt_digits, answer)
    assert (labels[:, :8] == IGNORE_INDEX).all() and torch.equal(labels[:, 8:], answer)


def test_demo_learns_the_task():
    result = train_demo(steps=30)
    assert result.final_loss < 0.5 * result.initial_loss
    assert result.answer_accuracy > 0.5


def test_demo_command_prints_the_patch_report_and_the_losses(capsys):
    assert cli.main(["demo", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "patch report" in out and "rms_norm" in out
    assert "Loss " in out
