"""`barqtrain generate RUN_OR_MODEL --prompt TEXT [--chat]`: text from a run's model, or a
Hugging Face model directory, with a KV cache (Transformers' generate over the patched model:
BarqTrain's ops compute the prompt, and fall back to Transformers' own where a cached step
needs it). Greedy by default; --temperature > 0 samples (seeded by --seed, so a run repeats).
It stops at the model's EOS, at the token the run's data ends each response with, and with
--chat at the chat template's end-of-turn tokens; --chat wraps the prompt as a user message in
the model's (or the run's, or a built-in) chat template, followed by the assistant's
generation prompt. The text is printed as the tokens come."""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch

from barqtrain.train.config import UsageError
from barqtrain.train.export import BUILT_IN_END_OF_TURN
from barqtrain.train.inference import LoadedModel, add_model_arguments, device_of, load_model

_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
DESCRIPTION = (
    "Generate text from a run's model (or a Hugging Face model directory) with a KV cache, greedy or sampled, "
    "stopping at the end-of-turn token; --chat uses the model's chat template. The text is printed as it is generated."
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
                        help="with --chat: 'model', chatml or llama3 (the data reader's built-in templates), a "
                             "tokenizer_config.json or .jinja file, or a template (default: the run's "
                             "data.chat_template, else 'model')")
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
    the chat template's end-of-turn tokens, each of which must be one token of the vocabulary."""
    from barqtrain.data import Tokenizer

    eos = loaded.model.generation_config.eos_token_id
    ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if loaded.end_token is not None:
        ids.append(loaded.end_token[0])
    if end_of_turn:
        tokenizer = Tokenizer.from_file(str(loaded.tokenizer_dir))
        for text in end_of_turn:
            encoded = tokenizer.encode(text, add_special_tokens=False)
            if len(encoded) != 1:
                raise UsageError(f"--chat: the template ends a turn with {text!r}, which is not one token of "
                                 f"{loaded.tokenizer_dir} ({len(encoded)} tokens), so generation could not stop at it; "
                                 "give --chat-template a template whose end-of-turn token the tokenizer has")
            ids.append(encoded[0])
    return sorted(set(ids))


class TextStream:
    """A streamer for Transformers' generate (which calls put with the prompt, then with each
    new token, then end): writes the text of the new tokens as they come, up to the first stop
    token, to out. What is written is always a beginning of the decoded text that more tokens
    will not change, so that at the end it is the decoded text:
    - byte-level BPE decodes all the bytes at once: a character whose bytes are split over
      tokens decodes as U+FFFD until its last byte comes, so trailing U+FFFDs wait;
    - SentencePiece's byte fallback decodes a run of byte tokens (<0xE6>) as one: its text if
      the bytes are UTF-8, else a U+FFFD per byte, so a run waits until a token ends it."""

    def __init__(self, tokenizer_dir: Path, stops: list[int], out: TextIO) -> None:
        from barqtrain.data import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(tokenizer_dir))
        self._byte_tokens = _byte_fallback_ids(tokenizer_dir)
        self._stops, self._out = set(stops), out
        self._ids: list[int] = []
        self._written = 0  # characters of the decoded text written
        self._prompt_seen = False
        self._stopped = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True  # the prompt, not printed
            return
        for token in value.reshape(-1).tolist():
            self._stopped = self._stopped or token in self._stops
            if self._stopped:
                return
            self._ids.append(token)
        self._write_decoded(final=False)

    def end(self) -> None:
        self._write_decoded(final=True)

    def _write_decoded(self, final: bool) -> None:
        settled_tokens = len(self._ids)
        while not final and settled_tokens and self._ids[settled_tokens - 1] in self._byte_tokens:
            settled_tokens -= 1
        text = self._tokenizer.decode(self._ids[:settled_tokens], skip_special_tokens=True)
        settled = text if final else text.rstrip("\ufffd")
        if len(settled) > self._written:
            self._out.write(settled[self._written:])
            self._out.flush()
            self._written = len(settled)


@torch.no_grad()
def generate(model, prompt_ids: list[int], stops: list[int], sampling: Sampling,
             streamer: TextStream | None = None) -> list[int]:
    """The new token ids after prompt_ids, the stop token (when reached) not included; each
    token also goes to streamer as it is produced."""
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
        eos_token_id=stops or None, pad_token_id=stops[0] if stops else 0, streamer=streamer, **options,
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
        return built_in_chat_prompt(name, prompt, loaded.tokenizer_dir), (BUILT_IN_END_OF_TURN[name],)
    if name == "model" and not _has_chat_template(loaded.tokenizer_dir):
        raise UsageError(f"--chat: {loaded.tokenizer_dir} has no chat template (a base model's tokenizer usually has "
                         f"none); pass --chat-template {' or '.join(BUILT_IN)} (built in), a .jinja file, a "
                         "tokenizer_config.json or a template string")
    template = ChatTemplate.load(name, loaded.tokenizer_dir)
    text = template.render([{"role": "user", "content": prompt}], add_generation_prompt=True)
    # As apply_chat_template(tokenize=True): the template writes the special tokens itself.
    return tokenizer.encode(text, add_special_tokens=False), template.end_of_turn_tokens


def built_in_chat_prompt(name: str, prompt: str, tokenizer_dir: Path) -> list[int]:
    """The tokens the data reader's built-in template `name` puts before an assistant's reply
    to the user message prompt, as training saw them: the reader itself reads a conversation of
    that message and an empty reply, which is cut where the reply's learned tokens begin."""
    from barqtrain.data import ReaderError, read_dataset

    conversation = {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": ""}]}
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "prompt.jsonl"
        path.write_text(json.dumps(conversation) + "\n", encoding="utf-8")
        try:
            record = read_dataset(path, "messages", str(tokenizer_dir), chat_template=name, add_eos=False)[0]
        except ReaderError as error:
            raise UsageError(f"--prompt: the {name} template cannot render it ({error})") from None
    reply = next(i for i, label in enumerate(record["labels"]) if label != -100)
    return record["input_ids"][:reply]


def _byte_fallback_ids(tokenizer_dir: Path) -> frozenset[int]:
    """The byte tokens (<0x00> to <0xFF>) of a tokenizer with SentencePiece's byte fallback."""
    path = tokenizer_dir / "tokenizer.json"
    if not path.is_file():
        return frozenset()  # a tiktoken file: byte-level
    model = json.loads(path.read_text(encoding="utf-8")).get("model") or {}
    if not model.get("byte_fallback"):
        return frozenset()
    return frozenset(token_id for text, token_id in model["vocab"].items() if _BYTE_TOKEN.fullmatch(text))


def _has_chat_template(tokenizer_dir: Path) -> bool:
    if (tokenizer_dir / "chat_template.jinja").is_file():
        return True
    try:
        return json.loads((tokenizer_dir / "tokenizer_config.json").read_text()).get("chat_template") is not None
    except (OSError, ValueError, AttributeError):
        return False


def run(args: argparse.Namespace) -> int:
    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_p, args.top_k, args.seed)
    check_sampling(sampling)
    loaded = load_model(args.model, device_of(args.device), base=args.base, patch=not args.no_patch,
                        log=lambda *a, **k: print(*a, **k, file=sys.stderr))
    ids, end_of_turn = prompt_ids(loaded, args.prompt, args.chat, args.chat_template)
    stops = stop_ids(loaded, end_of_turn)
    generate(loaded.model, ids, stops, sampling, TextStream(loaded.tokenizer_dir, stops, sys.stdout))
    print()
    return 0
