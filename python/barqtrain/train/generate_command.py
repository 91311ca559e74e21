"""`barqtrain generate RUN_OR_MODEL --prompt TEXT [--chat]`: text from a run's model, or a
Hugging Face model directory, with a KV cache (Transformers' generate over the patched model:
BarqTrain's ops compute the prompt, and fall back to Transformers' own where a cached step
needs it). Greedy by default; --temperature > 0 samples (seeded by --seed, so a run repeats).
It stops at the model's EOS, at the token the run's data ends each response with, and with
--chat at the chat template's end-of-turn tokens; --chat wraps the prompt as a user message in
the model's (or the run's) chat template, followed by the assistant's generation prompt."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from barqtrain.train.config import UsageError
from barqtrain.train.inference import LoadedModel, add_model_arguments, device_of, load_model

DESCRIPTION = (
    "Generate text from a run's model (or a Hugging Face model directory) with a KV cache, greedy or sampled, "
    "stopping at the end-of-turn token; --chat uses the model's chat template."
)


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int = 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="generate text from a run's model", description=DESCRIPTION)
    add_model_arguments(parser)
    parser.add_argument("--prompt", required=True, metavar="TEXT", help="the text to continue (with --chat: the "
                        "user's message)")
    parser.add_argument("--chat", action="store_true", help="render the prompt with the chat template first")
    parser.add_argument("--chat-template", metavar="TEMPLATE",
                        help="with --chat: 'model', a tokenizer_config.json or .jinja file, or a template "
                             "(default: the run's data.chat_template, else 'model')")
    parser.add_argument("--max-new-tokens", type=int, default=Sampling.max_new_tokens, metavar="N")
    parser.add_argument("--temperature", type=float, default=Sampling.temperature,
                        help="0 (the default): greedy; above 0: sample at this temperature")
    parser.add_argument("--top-p", type=float, default=Sampling.top_p, help="nucleus sampling's mass (default 1)")
    parser.add_argument("--top-k", type=int, default=Sampling.top_k, help="sample among the k likeliest (0: all)")
    parser.add_argument("--seed", type=int, default=Sampling.seed, help="the sampling's seed")
    parser.set_defaults(run=run)


def check_sampling(sampling: Sampling) -> None:
    if sampling.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens {sampling.max_new_tokens}: must be at least 1")
    if sampling.temperature < 0:
        raise UsageError(f"--temperature {sampling.temperature}: must be 0 (greedy) or above")
    if not 0 < sampling.top_p <= 1:
        raise UsageError(f"--top-p {sampling.top_p}: must be in (0, 1]")
    if sampling.top_k < 0:
        raise UsageError(f"--top-k {sampling.top_k}: must be 0 (no cut) or above")


def stop_ids(loaded: LoadedModel, end_of_turn: tuple[str, ...] = ()) -> list[int]:
    """The ids generation stops at: the generation config's EOS, the run's trained end token and
    the given end-of-turn tokens (each a single token of the vocabulary)."""
    from barqtrain.data import Tokenizer

    eos = loaded.model.generation_config.eos_token_id
    ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if loaded.end_token is not None:
        ids.append(loaded.end_token[0])
    if end_of_turn:
        tokenizer = Tokenizer.from_file(str(loaded.tokenizer_dir))
        for text in end_of_turn:
            encoded = tokenizer.encode(text, add_special_tokens=False)
            if len(encoded) == 1:
                ids.append(encoded[0])
    return sorted(set(ids))


@torch.no_grad()
def generate(model, prompt_ids: list[int], stops: list[int], sampling: Sampling) -> list[int]:
    """The new token ids after prompt_ids, the stop token (when reached) not included."""
    check_sampling(sampling)
    if not prompt_ids:
        raise UsageError("--prompt: encodes to no token; give some text")
    torch.manual_seed(sampling.seed)
    sampled = sampling.temperature > 0
    options = dict(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k) \
        if sampled else dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    input_ids = torch.tensor([prompt_ids], device=model.device)
    output = model.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=sampling.max_new_tokens, use_cache=True,
        eos_token_id=stops or None, pad_token_id=stops[0] if stops else 0, **options,
    )[0, len(prompt_ids):].tolist()
    end = next((i for i, token in enumerate(output) if token in stops), len(output))
    return output[:end]


def prompt_ids(
    loaded: LoadedModel, prompt: str, chat: bool, chat_template: str | None
) -> tuple[list[int], tuple[str, ...]]:
    """The prompt's token ids (rendered with the chat template when chat) and the template's end-of-turn tokens."""
    from barqtrain.data import Tokenizer
    from barqtrain.data.chat_template import BUILT_IN, ChatTemplate

    if loaded.tokenizer_dir is None:
        raise UsageError("the model has no tokenizer directory to encode --prompt with")
    tokenizer = Tokenizer.from_file(str(loaded.tokenizer_dir))
    if not chat:
        return tokenizer.encode(prompt), ()
    name = chat_template or loaded.data.get("chat_template") or "model"
    if name in BUILT_IN:
        raise UsageError(f"--chat: the run's data.chat_template is the built-in {name!r}, rendered by the data reader "
                         "only; pass --chat-template with its Jinja template (a .jinja file or tokenizer_config.json)")
    if name == "model" and not _has_chat_template(loaded.tokenizer_dir):
        raise UsageError(f"--chat: {loaded.tokenizer_dir} has no chat template (a base model's tokenizer usually has "
                         "none); pass --chat-template with a .jinja file, a tokenizer_config.json or a template string")
    template = ChatTemplate.load(name, loaded.tokenizer_dir)
    text = template.render([{"role": "user", "content": prompt}], add_generation_prompt=True)
    # As apply_chat_template(tokenize=True): the template writes the special tokens itself.
    return tokenizer.encode(text, add_special_tokens=False), template.end_of_turn_tokens


def _has_chat_template(tokenizer_dir: Path) -> bool:
    if (tokenizer_dir / "chat_template.jinja").is_file():
        return True
    try:
        return json.loads((tokenizer_dir / "tokenizer_config.json").read_text()).get("chat_template") is not None
    except (OSError, ValueError, AttributeError):
        return False


def run(args: argparse.Namespace) -> int:
    from barqtrain.data import Tokenizer

    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_p, args.top_k, args.seed)
    check_sampling(sampling)
    loaded = load_model(args.model, device_of(args.device), base=args.base, patch=not args.no_patch,
                        log=lambda *a, **k: print(*a, **k, file=sys.stderr))
    ids, end_of_turn = prompt_ids(loaded, args.prompt, args.chat, args.chat_template)
    new = generate(loaded.model, ids, stop_ids(loaded, end_of_turn), sampling)
    print(Tokenizer.from_file(str(loaded.tokenizer_dir)).decode(new, skip_special_tokens=True))
    return 0
