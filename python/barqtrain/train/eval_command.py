"""`barqtrain eval RUN_OR_MODEL --data FILE`: the mean loss (nats per token) and perplexity of
a run's model, or a Hugging Face model directory, on a held-out file read as the trainer reads
data (text, alpaca, messages, pretokenized; only the tokens the format learns are scored).

A sequence longer than the context is scored with a sliding window: windows of --context
tokens, each starting --stride tokens after the previous one, score only the tokens the
previous window did not, each with the window's tokens before it as context (the fixed-length
perplexity of the Transformers documentation: --stride equal to --context gives disjoint
windows; a smaller stride gives each token more context and costs more forwards). Every
scored token is counted once; a sequence's first token has no context and is not scored."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch

from barqtrain.train.config import UsageError
from barqtrain.train.inference import add_model_arguments, device_of, load_model

DESCRIPTION = (
    "Loss and perplexity of a run's model (or a Hugging Face model directory) on a held-out file, with a sliding "
    "window over sequences longer than the context; on the GPU with BarqTrain's ops."
)
FORMATS = ("text", "alpaca", "messages", "pretokenized")
DEFAULT_CONTEXT = 2048  # capped at the model's max_position_embeddings


@dataclass(frozen=True)
class Evaluation:
    loss: float  # mean negative log-likelihood of the scored tokens, in nats
    perplexity: float  # exp(loss)
    tokens: int  # tokens scored
    sequences: int
    windows: int  # forwards run


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("eval", help="loss and perplexity on a held-out file", description=DESCRIPTION)
    add_model_arguments(parser)
    parser.add_argument("--data", metavar="FILE", required=True,
                        help="JSONL/JSON/text/Parquet records, or a `barqtrain tokenize` directory")
    parser.add_argument("--format", choices=FORMATS,
                        help="how to read --data (default: the run's data.format, else text)")
    parser.add_argument("--text-unit", choices=("line", "document"), default="line",
                        help="for a plain-text file: a sequence per line (default) or the whole file as one")
    parser.add_argument("--chat-template", metavar="TEMPLATE",
                        help="for --format messages: as data.chat_template (default: the run's, else 'model')")
    parser.add_argument("--context", type=int, metavar="N",
                        help=f"tokens per window (default: the run's data.seq_length, else {DEFAULT_CONTEXT}; at most "
                             "the model's max_position_embeddings)")
    parser.add_argument("--stride", type=int, metavar="N", help="tokens between window starts (default: context / 2)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    parser.set_defaults(run=run)


@torch.no_grad()
def sequence_nll(
    model, input_ids: torch.Tensor, labels: torch.Tensor, context: int, stride: int
) -> tuple[float, int, int]:
    """(summed negative log-likelihood, tokens scored, windows run) of one sequence: token t
    (t >= 1, labels[t] != -100) is scored once, by the first window that holds it and does not
    start at it, given the tokens of that window before it."""
    length = len(input_ids)
    total, count, windows = 0.0, 0, 0
    scored_until = 1  # tokens before this one are scored (or, the first, never are)
    begin = 0
    while scored_until < length:
        end = min(begin + context, length)
        first = max(scored_until, begin + 1)
        targets = labels[first:end]
        if (targets != -100).any():
            window = input_ids[begin:end].to(model.device)[None]
            # Only the logits that predict tokens first..end-1: positions first-1..end-2.
            logits = model(input_ids=window, use_cache=False, logits_to_keep=end - first + 1).logits[0, :-1]
            total += torch.nn.functional.cross_entropy(
                logits.float(), targets.to(logits.device).long(), ignore_index=-100, reduction="sum"
            ).item()
            count += int((targets != -100).sum())
            windows += 1
        scored_until = end
        begin += stride
    return total, count, windows


def evaluate(model, sequences: Iterable[dict[str, list[int]]], context: int, stride: int) -> Evaluation:
    """The loss and perplexity of model over sequences ({"input_ids", "labels"} each)."""
    if not 0 < stride <= context:
        raise UsageError(f"--stride {stride}: must be between 1 and --context ({context})")
    total, count, windows, number = 0.0, 0, 0, 0
    for number, sequence in enumerate(sequences, 1):
        nll, scored, forwards = sequence_nll(
            model, torch.tensor(sequence["input_ids"]), torch.tensor(sequence["labels"]), context, stride
        )
        total, count, windows = total + nll, count + scored, windows + forwards
    if count == 0:
        raise UsageError("--data: no token to score (empty, or every sequence a single token or masked)")
    loss = total / count
    return Evaluation(loss, math.exp(loss), count, number, windows)


def _window(args: argparse.Namespace, data: dict, max_positions: int | None) -> tuple[int, int]:
    context = args.context or data.get("seq_length") or DEFAULT_CONTEXT
    if args.context is None and max_positions:
        context = min(context, max_positions)
    if context < 2:
        raise UsageError(f"--context {context}: must be at least 2 tokens")
    if max_positions and context > max_positions:
        raise UsageError(f"--context {context}: above the model's max_position_embeddings ({max_positions}); give "
                         "at most that")
    return context, args.stride or max(context // 2, 1)


def run(args: argparse.Namespace) -> int:
    from barqtrain.data import read_dataset

    log = (lambda *a, **k: print(*a, **k, file=sys.stderr)) if args.json else print
    device = device_of(args.device)
    loaded = load_model(args.model, device, base=args.base, patch=not args.no_patch, log=log)
    config = loaded.model.config.get_text_config()
    context, stride = _window(args, loaded.data, getattr(config, "max_position_embeddings", None))
    fmt = args.format or loaded.data.get("format") or "text"
    chat_template = args.chat_template or loaded.data.get("chat_template") or "model"
    if fmt == "pretokenized":
        dataset = read_dataset(args.data, "pretokenized")
    else:
        if loaded.tokenizer_dir is None:
            raise UsageError(f"{args.model}: no tokenizer directory to read --data with")
        dataset = read_dataset(args.data, fmt, str(loaded.tokenizer_dir), text_unit=args.text_unit,
                               chat_template=chat_template)
    if dataset.max_token_id() >= config.vocab_size:
        raise UsageError(f"--data {args.data}: token id {dataset.max_token_id()} is beyond the model's vocabulary "
                         f"({config.vocab_size}); was it tokenized with another tokenizer?")
    result = evaluate(loaded.model, (dataset[i] for i in range(len(dataset))), context, stride)
    if args.json:
        print(json.dumps({**asdict(result), "context": context, "stride": stride, "model": str(args.model),
                          "data": str(args.data), "format": fmt, "device": str(device),
                          "patched": not args.no_patch}))
    else:
        print(f"{loaded.description} on {device}.")
        print(f"{args.data}: loss {result.loss:.4f}, perplexity {result.perplexity:.3f} over {result.tokens:,} tokens "
              f"of {result.sequences:,} sequences ({result.windows:,} windows of up to {context} tokens, stride "
              f"{stride}).")
    return 0
