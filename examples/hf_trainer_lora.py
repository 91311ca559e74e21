"""barqtrain.patch_model inside an ordinary Hugging Face Trainer script: LoRA on a tiny
random Llama learning the repeat-digits task. CPU, no downloads, well under a minute.

    PYTHONPATH=python python examples/hf_trainer_lora.py [--out DIR]

The only BarqTrain line is `barqtrain.patch_model(model)`, before the Trainer is built.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainingArguments

import barqtrain
from barqtrain.train import task


class DigitsDataset(torch.utils.data.Dataset):
    """[BOS, digits, SEP, digits] rows; the labels score the repeated digits only."""

    def __init__(self, rows: int, seed: int) -> None:
        self.input_ids, self.labels = task.make_batch(rows, torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[i], "labels": self.labels[i]}


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="output directory (default: a temporary one)")
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**task.TINY_LLAMA))
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))
    print(barqtrain.patch_model(model))  # before the Trainer is built; works on the PEFT model

    train_set, eval_set = DigitsDataset(64 * args.steps, seed=1), DigitsDataset(128, seed=2)
    out = args.out or tempfile.mkdtemp(prefix="hf_trainer_lora-")
    trainer = Trainer(
        model=model,
        args=TrainingArguments(
            output_dir=out,
            max_steps=args.steps,
            per_device_train_batch_size=64,
            per_device_eval_batch_size=64,
            learning_rate=1e-2,
            warmup_steps=5,
            lr_scheduler_type="cosine",
            logging_steps=10,
            eval_strategy="no",
            save_strategy="no",
            report_to=[],
            use_cpu=not torch.cuda.is_available(),
            seed=0,
        ),
        train_dataset=train_set,
        eval_dataset=eval_set,
    )
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]

    # Evaluation outputs carry logits (the fused loss skips them only in training).
    batch = eval_set[:64]
    accuracy = task.answer_accuracy(model, batch["input_ids"].to(model.device), batch["labels"].to(model.device))
    print(f"eval loss {before:.4f} -> {after:.4f}; digit accuracy after training {100 * accuracy:.0f}% (10% is chance)")
    model.save_pretrained(f"{out}/adapter")
    print(f"adapter in {out}/adapter")
    return {"eval_loss_before": before, "eval_loss_after": after, "accuracy": accuracy}


if __name__ == "__main__":
    main()
