"""What `barqtrain export` needs besides the merge: an output directory written whole or not at
all (a temporary sibling renamed into place, never replacing what BarqTrain did not write),
the base model's dtype, its tokenizer files and generation config, and the end-of-turn token
the run's data taught the model, checked against the exported generation config."""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from barqtrain.train.config import ConfigError

MARKER = "barqtrain_export.json"  # in every export: what was exported, and the files written
GENERATION_CONFIG = "generation_config.json"
# The files of a Hugging Face tokenizer (fast, slow, SentencePiece, BPE, WordPiece, tiktoken)
# and its chat template, whatever a model directory has of them.
_TOKENIZER_NAMES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
    "spiece.model", "sentencepiece.bpe.model", "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja",
    "chat_template.json",
)
_TOKENIZER_SUFFIXES = (".tiktoken",)
_DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
                "F32": "float32", "BF16": "bfloat16", "F16": "float16"}
# The end-of-turn token the built-in chat templates write after each assistant message.
BUILT_IN_END_OF_TURN = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>"}


class ExportError(ConfigError):
    """A user error of `barqtrain export`: one line naming the file or option and what to do."""


# ---------------------------------------------------------------------------- output


def check_out(out: Path, overwrite: bool) -> None:
    """Refuses an --out that export must not write: a file, a non-empty directory without
    --overwrite, or (with --overwrite) one that is not a BarqTrain export or holds files the
    export did not write."""
    if out.is_symlink():
        raise ExportError(f"--out {out}: is a symbolic link; give the directory it points to, or a new path")
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out}: is a file, not a directory; give a directory path for the exported model")
    for parent in out.parents:
        if parent.exists() and not parent.is_dir():
            raise ExportError(f"--out {out}: {parent} is a file, not a directory; give a directory path")
    if not out.exists() or not any(out.iterdir()):
        return
    if not overwrite:
        raise ExportError(
            f"--out {out}: exists and is not empty; give a new directory, or pass --overwrite to replace "
            "an earlier `barqtrain export` there"
        )
    written = _files_written(out)
    if written is None:
        raise ExportError(
            f"--out {out}: not written by `barqtrain export` (no {MARKER}), so --overwrite leaves it alone; "
            "give a new directory, or remove it yourself"
        )
    others = sorted(str(p.relative_to(out)) for p in out.rglob("*") if not p.is_dir() and
                    str(p.relative_to(out)) not in written)
    if others:
        shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        raise ExportError(
            f"--out {out}: holds files `barqtrain export` did not write ({shown}), so --overwrite leaves it alone; "
            "move them out, or give a new directory"
        )


def _files_written(out: Path) -> set[str] | None:
    """The files an earlier export recorded in its marker (and the marker), or None when out has no valid marker."""
    try:
        marker = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return None
    files = marker.get("files") if isinstance(marker, dict) else None
    if not isinstance(files, list):
        return None
    return {str(name) for name in files} | {MARKER}


@contextmanager
def atomic_directory(out: Path) -> Iterator[Path]:
    """Yields a temporary sibling of out to fill; when the block ends without an error it
    replaces out (an empty directory, or an earlier export that check_out let through), else it
    is removed and out is as it was."""
    temporary = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    for leftover in (temporary, old):  # this process's own names: a crash's leftovers of an earlier export
        shutil.rmtree(leftover, ignore_errors=True)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        temporary.mkdir()
    except OSError as error:
        raise ExportError(f"--out {out}: cannot create a directory in {out.parent} ({error.strerror}); "
                          "give a directory you can write to") from None
    try:
        yield temporary
        if out.exists():
            if any(out.iterdir()):
                os.replace(out, old)  # check_out allowed only an earlier export here
            else:
                out.rmdir()
        os.replace(temporary, out)
    except BaseException as error:
        shutil.rmtree(temporary, ignore_errors=True)
        if old.exists() and not out.exists():
            os.replace(old, out)
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ExportError(f"--out {out}: no space left on the device while writing the export; nothing was "
                              "written: free some space (or give --out on another disk) and export again") from None
        raise
    shutil.rmtree(old, ignore_errors=True)


def write_marker(directory: Path, what: dict[str, Any]) -> None:
    """barqtrain_export.json: what was exported and every file written, so that --overwrite
    knows the directory as BarqTrain's."""
    files = sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if not p.is_dir())
    (directory / MARKER).write_text(json.dumps({**what, "files": files}, indent=2) + "\n")


# ------------------------------------------------------------------------- base model


def base_dtype(base_dir: str | Path) -> str:
    """The base model's dtype (float32, bfloat16 or float16): config.json's dtype (torch_dtype
    in older files), else the first floating tensor of its safetensors, else float32."""
    base_dir = Path(base_dir)
    try:
        config = json.loads((base_dir / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    for key in ("dtype", "torch_dtype"):
        if config.get(key) in _DTYPE_NAMES:
            return _DTYPE_NAMES[config[key]]
    for shard in sorted(base_dir.glob("*.safetensors")):
        try:
            with shard.open("rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
        except (OSError, ValueError, struct.error):
            continue
        for name, entry in header.items():
            if name != "__metadata__" and entry.get("dtype") in _DTYPE_NAMES:
                return _DTYPE_NAMES[entry["dtype"]]
    return "float32"


def tokenizer_files(directory: str | Path) -> list[Path]:
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.is_file() and
                  (p.name in _TOKENIZER_NAMES or p.name.endswith(_TOKENIZER_SUFFIXES)))


def copy_tokenizer_and_generation_config(
    tokenizer_dir: Path | None, base_dir: Path | None, out: Path
) -> tuple[list[str], bool]:
    """Copies the tokenizer files of tokenizer_dir and the base's generation_config.json into
    out; returns (the tokenizer files copied, whether generation_config.json was copied)."""
    copied = []
    for path in tokenizer_files(tokenizer_dir) if tokenizer_dir is not None else []:
        shutil.copy2(path, out / path.name)
        copied.append(path.name)
    generation = base_dir is not None and (base_dir / GENERATION_CONFIG).is_file()
    if generation:
        shutil.copy2(base_dir / GENERATION_CONFIG, out / GENERATION_CONFIG)
    return copied, generation


# ---------------------------------------------------------------------- end of turn


def tokenizer_dir_of(data: dict[str, Any], base_dir: Path | None) -> Path | None:
    """The directory of the tokenizer the run's data was read with: data.tokenizer (a
    directory or its tokenizer.json), else (or when that has gone) the base model directory."""
    tokenizer = data.get("tokenizer")
    if tokenizer:
        path = Path(tokenizer)
        path = path if path.is_dir() else path.parent
        if path.is_dir() or base_dir is None:
            return path
    return base_dir


def trained_end_token(data: dict[str, Any], tokenizer_dir: Path | None) -> tuple[int, str] | None:
    """(id, text) of the token that ends each response in the run's data, as its reader
    rendered it: the EOS appended to text and alpaca records (tokenizer_config.json's
    eos_token), the end-of-turn token a chat template writes after an assistant message, the
    EOS a `barqtrain tokenize` directory recorded. None when the data appends none (the
    built-in task, a tokenizer without an EOS). Raises ExportError when it cannot be told."""
    from barqtrain.data import ReaderError, Tokenizer, TokenizerError

    fmt = data.get("format") or "text"
    if not data.get("path"):
        return None  # the built-in synthetic task: no end-of-turn token
    if fmt == "pretokenized":
        try:
            metadata = json.loads((Path(data["path"]) / "shards.json").read_text()).get("metadata", {})
        except (OSError, ValueError):
            return None
        eos = metadata.get("eos_id", -1)
        return (int(eos), _decode(tokenizer_dir, int(eos))) if isinstance(eos, int) and eos >= 0 else None
    if tokenizer_dir is None or not tokenizer_dir.is_dir():
        raise ExportError(f"the tokenizer directory {tokenizer_dir} the run's data was read with does not exist")
    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_dir))
        if fmt == "messages":
            text = _chat_end_of_turn(data.get("chat_template") or "model", tokenizer_dir)
        else:
            from barqtrain.data.readers import _eos_from_config

            text = _eos_from_config(str(tokenizer_dir))
        if text is None:
            return None
        ids = tokenizer.encode(text, add_special_tokens=False)
    except (ReaderError, TokenizerError) as error:
        raise ExportError(f"{tokenizer_dir}: {error}") from None
    if len(ids) != 1:
        raise ExportError(
            f"the run's data ends each response with {text!r}, which is not a single token of {tokenizer_dir}, "
            "so no generation config can stop on it"
        )
    return ids[0], text


def _chat_end_of_turn(chat_template: str, tokenizer_dir: Path) -> str | None:
    """The end-of-turn token a chat template writes right after an assistant message (the
    last of what is learned), found by rendering a short conversation as the reader does."""
    if chat_template in BUILT_IN_END_OF_TURN:
        return BUILT_IN_END_OF_TURN[chat_template]
    from barqtrain.data.chat_template import ChatTemplate

    template = ChatTemplate.load(chat_template, tokenizer_dir)
    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    text, trained = template.render_trained(probe)
    if not trained:
        return None
    learned = text[trained[-1][0]:trained[-1][1]]
    return next((token for token in template.end_of_turn_tokens if learned.endswith(token)), None)


def _decode(tokenizer_dir: Path | None, token_id: int) -> str:
    try:
        from barqtrain.data import Tokenizer

        return Tokenizer.from_file(str(tokenizer_dir)).decode([token_id])
    except Exception:  # only for the message: the id says it all
        return f"id {token_id}"


def ensure_eos(out: Path, end: tuple[int, str], log: Callable[..., None]) -> list[int]:
    """Makes the exported generation_config.json's eos_token_id include end's id (adding it,
    with one line saying so, when it does not); returns the eos_token_id list written."""
    token_id, text = end
    path = out / GENERATION_CONFIG
    config = json.loads(path.read_text()) if path.is_file() else {}
    eos = config.get("eos_token_id")
    ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if token_id in ids:
        return ids
    ids.append(token_id)
    config["eos_token_id"] = ids[0] if len(ids) == 1 else ids
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    before = "none" if eos is None else json.dumps(eos)
    log(
        f"{GENERATION_CONFIG}: eos_token_id was {before}, without {token_id} ({text!r}), the token the run's data "
        f"ends each response with; added it, so that generation stops there."
    )
    return ids
