"""barqtrain.data.Tokenizer: Hugging Face tokenizer.json files, encoded in C++.

    tok = Tokenizer.from_file("tokenizer.json")
    ids = tok.encode("Hello world")
    ids, offsets = tok.encode("Hello world", offsets=True)  # (start, end) in characters
    batch = tok.encode_batch(texts)          # all cores, without the GIL
    ids, offsets = tok.encode_batch_flat(texts)  # the same in two NumPy arrays
    text = tok.decode(ids)

The ids and offsets are identical to those of ``tokenizers.Tokenizer.from_file(path).encode(text)``.
Byte-level BPE tokenizers (GPT-2, Llama-3, Qwen2/2.5, Phi-3, SmolLM) and SentencePiece-style
BPE ones (Llama-2, Mistral, Gemma: byte_fallback, Metaspace, Prepend/Replace normalizers) are
supported, with any Split regex (PCRE2), Digits and every added-token option; loading any other
tokenizer.json feature raises TokenizerError naming it (docs/tokenizer.md lists them).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Literal, overload

import numpy as np

try:
    from barqtrain.data import _native
except ImportError as error:  # pragma: no cover - only in an unbuilt source tree
    raise ImportError(
        "barqtrain's data module (barqtrain/data/_native) is missing: the package was imported "
        "from a source tree that was never built. Install it with `make install` (or `pip install "
        "--no-build-isolation .`) and import the installed package."
    ) from error

TokenizerError = _native.TokenizerError


class Tokenizer:
    """A tokenizer loaded from a Hugging Face tokenizer.json; safe to share between threads."""

    def __init__(self, native: _native.Tokenizer) -> None:
        self._native = native

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Tokenizer:
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        return cls(_native.Tokenizer.from_file(path))

    @overload
    def encode(
        self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False,
        offsets: Literal[False] = False,
    ) -> list[int]: ...

    @overload
    def encode(
        self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False, *,
        offsets: Literal[True],
    ) -> tuple[list[int], list[tuple[int, int]]]: ...

    def encode(self, text, add_special_tokens=True, split_special_tokens=False, offsets=False):
        """Token ids of text. add_special_tokens adds what the post-processor adds (BOS, EOS);
        split_special_tokens reads special tokens written in the text as plain text. With
        offsets, returns (ids, offsets): each token's (start, end) in characters of text, as
        Hugging Face's Encoding.offsets ((0, 0) for tokens the post-processor adds)."""
        if offsets:
            return self._native.encode_with_offsets(text, add_special_tokens, split_special_tokens)
        return self._native.encode(text, add_special_tokens, split_special_tokens)

    @overload
    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = True, split_special_tokens: bool = False,
        num_threads: int = 0, offsets: Literal[False] = False,
    ) -> list[list[int]]: ...

    @overload
    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = True, split_special_tokens: bool = False,
        num_threads: int = 0, *, offsets: Literal[True],
    ) -> list[tuple[list[int], list[tuple[int, int]]]]: ...

    def encode_batch(self, texts, add_special_tokens=True, split_special_tokens=False, num_threads=0, offsets=False):
        """encode() of each text, on num_threads threads (0: every core) of a persistent pool,
        without the GIL; with offsets, (ids, offsets) for each text as encode(offsets=True)."""
        if offsets:
            return self._native.encode_batch_with_offsets(texts, add_special_tokens, split_special_tokens, num_threads)
        return self._native.encode_batch(texts, add_special_tokens, split_special_tokens, num_threads)

    def encode_batch_flat(
        self,
        texts: Sequence[str],
        add_special_tokens: bool = True,
        split_special_tokens: bool = False,
        num_threads: int = 0,
    ) -> tuple[np.ndarray, np.ndarray]:
        """encode_batch() without a Python object per id: (ids, offsets), NumPy arrays of
        uint32 and int64 where text i's ids are ids[offsets[i]:offsets[i + 1]]."""
        return self._native.encode_batch_flat(texts, add_special_tokens, split_special_tokens, num_threads)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of ids; byte sequences that are not valid UTF-8 decode to U+FFFD."""
        return self._native.decode(list(ids), skip_special_tokens)

    @property
    def id_bound(self) -> int:
        """One more than the largest token id, added tokens included."""
        return self._native.id_bound
