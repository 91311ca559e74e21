"""The built-in repeat-digits task of `barqtrain train`'s embedded default."""

import torch

from barqtrain.train.task import IGNORE_INDEX, make_batch


def test_batches_score_only_the_repeated_digits():
    input_ids, labels = make_batch(3, torch.Generator().manual_seed(0))
    prompt_digits, answer = input_ids[:, 1:7], input_ids[:, 8:]
    assert torch.equal(prompt_digits, answer)
    assert (labels[:, :8] == IGNORE_INDEX).all() and torch.equal(labels[:, 8:], answer)
