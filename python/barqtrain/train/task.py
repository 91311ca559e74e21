"""The built-in synthetic task: repeat random digits after a separator.

A random model cannot do it (10% of the digits right by chance); a few dozen LoRA steps on
a tiny Llama teach it. Shared by `barqtrain train`'s embedded default and `barqtrain demo`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PAD, BOS, SEPARATOR = 0, 1, 2
FIRST_DIGIT = 10  # token ids FIRST_DIGIT .. FIRST_DIGIT + 9 are the digits 0 .. 9
DIGITS_PER_SEQUENCE = 6
IGNORE_INDEX = -100  # HF's label for positions outside the loss
SEQUENCE_LENGTH = 2 * DIGITS_PER_SEQUENCE + 2

TINY_LLAMA = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=64,
    # Wider than HF's 0.02: the frozen random output layer must be able to single out the digits.
    initializer_range=0.05,
    pad_token_id=PAD,
    bos_token_id=BOS,
    use_cache=False,
)


def make_batch(batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """[BOS, d1..dn, SEP, d1..dn]: input ids, and labels that score the repeated digits only."""
    digits = FIRST_DIGIT + torch.randint(10, (batch_size, DIGITS_PER_SEQUENCE), generator=generator)
    bos = torch.full((batch_size, 1), BOS)
    separator = torch.full((batch_size, 1), SEPARATOR)
    input_ids = torch.cat([bos, digits, separator, digits], dim=1)
    labels = input_ids.clone()
    labels[:, : DIGITS_PER_SEQUENCE + 2] = IGNORE_INDEX  # the prompt is given, not learned
    return input_ids, labels


def make_packed_rows(rows: int, seq_length: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Rows of seq_length tokens, each packing seq_length // SEQUENCE_LENGTH sequences of
    make_batch end to end and padding the rest (not scored). position_ids restart at every
    sequence (and the padding), so no token attends across a boundary: the format of
    DataCollatorWithFlattening and of barqtrain's packed dataset rows."""
    per_row = seq_length // SEQUENCE_LENGTH
    padding = seq_length - per_row * SEQUENCE_LENGTH
    input_ids, labels = make_batch(rows * per_row, generator)
    positions = torch.cat([torch.arange(SEQUENCE_LENGTH).repeat(per_row), torch.arange(padding)])
    return {
        "input_ids": F.pad(input_ids.reshape(rows, -1), (0, padding), value=PAD),
        "labels": F.pad(labels.reshape(rows, -1), (0, padding), value=IGNORE_INDEX),
        "position_ids": positions.repeat(rows, 1),
    }


@torch.no_grad()
def answer_accuracy(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of the scored tokens that the model predicts right (greedy, teacher-forced)."""
    was_training = model.training
    model.eval()
    predictions = model(input_ids=input_ids, use_cache=False).logits[:, :-1].argmax(-1)
    model.train(was_training)
    targets = labels[:, 1:]
    scored = targets != IGNORE_INDEX
    return (predictions[scored] == targets[scored]).float().mean().item()
