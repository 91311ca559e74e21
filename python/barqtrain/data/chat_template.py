"""A model's own chat template: conversations rendered with the Jinja template of its
tokenizer_config.json exactly as transformers' ``tokenizer.apply_chat_template(messages,
tokenize=False)`` renders them, with the character ranges the model learns.

    template = ChatTemplate.load("model", "path/to/model")   # or a tokenizer_config.json, a .jinja file, a template string
    text, trained = template.render_trained(messages)          # trained: [(begin, end), ...] in characters

What is learned (the rule of TRL's assistant_only_loss): each assistant message's content and
the end-of-turn token the template writes right after it (<|eot_id|>, <|im_end|>,
<end_of_turn>, </s>, ...), nothing else. A template with {% generation %} blocks says exactly
what is learned, as with transformers' return_assistant_tokens_mask. Otherwise an assistant
turn starts where the rendering of the messages before it, with the generation prompt, ends
(a rendering that is not a prefix of the whole conversation's is an error) and ends after its
content and that end-of-turn token.

The dataset readers call render_records on a chunk of records at a time (Jinja is Python);
tokenizing, masking and everything after run in C++ (barqtrain.data.read_dataset).
"""

from __future__ import annotations

import json
import os
import re
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from barqtrain.data import _native

ReaderError = _native.ReaderError

BUILT_IN = ("chatml", "llama3")  # rendered by the C++ reader itself
ROLES = ("system", "user", "assistant", "tool")
# The named special tokens transformers passes to every template (its special_tokens_map).
_NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_END_OF_TURN_NAME = re.compile(r"end|eot|</s>", re.IGNORECASE)


class _GenerationSpans(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %}: records where its output lands in the rendering.
    The rendering is consumed chunk by chunk (Template.generate), so the text rendered before
    a block is the length of the chunks already seen."""

    tags = frozenset(("generation",))

    def __init__(self, environment: jinja2.Environment) -> None:
        super().__init__(environment)
        self.chunks: list[str] | None = None
        self.spans: list[tuple[int, int]] = []

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_record"), [], [], body).set_lineno(lineno)

    def _record(self, caller: Any) -> str:
        text = caller()
        if self.chunks is not None:
            start = sum(map(len, self.chunks))
            self.spans.append((start, start + len(text)))
        return text


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # transformers' tojson: no HTML escaping (Jinja's own escapes <, >, &, ')
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as error:
        raise ReaderError(f"{path}: cannot read the chat template's file: {error}") from error


def _pick_template(value: Any, where: str) -> str:
    """tokenizer_config.json's chat_template: a string, or named templates (the "default" one)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise ReaderError(f"{where}: chat_template lists templates {sorted(map(str, named))} but none named 'default'")
    raise ReaderError(f"{where}: chat_template is a {type(value).__name__}, expected a string or a list of named templates")


class ChatTemplate:
    """A Jinja chat template with the special tokens it is rendered with (bos_token, eos_token, ...)."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None,
                 added_special_tokens: tuple[str, ...] = (), name: str = "chat template") -> None:
        self.source = source
        self.name = name
        self.special_tokens = dict(special_tokens or {})
        # Tokens that can end a turn: the EOS and special tokens named like an end.
        ends = {t for t in added_special_tokens if _END_OF_TURN_NAME.search(t)}
        if self.special_tokens.get("eos_token"):
            ends.add(self.special_tokens["eos_token"])
        self.end_of_turn_tokens = tuple(sorted(ends, key=len, reverse=True))
        self.has_generation_blocks = bool(_GENERATION_TAG.search(source))
        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationSpans, jinja2.ext.loopcontrols]
        )
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise_exception
        environment.globals["strftime_now"] = _strftime_now
        try:
            self._template = environment.from_string(source)
        except jinja2.TemplateSyntaxError as error:
            raise ReaderError(f"{name}: not a valid Jinja template: {error} (line {error.lineno})") from error
        self._generation = environment.extensions[_GenerationSpans.identifier]

    @classmethod
    def load(cls, chat_template: str, tokenizer_dir: str | os.PathLike[str] | None = None) -> ChatTemplate:
        """chat_template: "model" (the tokenizer directory's tokenizer_config.json, or its
        chat_template.jinja), a path to a tokenizer_config.json or a .jinja file, or the template
        itself. Special tokens come from that tokenizer_config.json, else the tokenizer directory's."""
        tokenizer_dir = os.fspath(tokenizer_dir) if tokenizer_dir is not None else None
        config_path = os.path.join(tokenizer_dir, "tokenizer_config.json") if tokenizer_dir else None
        if chat_template == "model":
            if tokenizer_dir is None:
                raise ReaderError(
                    "chat_template='model' reads the template from the tokenizer directory's tokenizer_config.json, "
                    "but the tokenizer was given as an object: pass the tokenizer directory, or chat_template as a "
                    "path to a tokenizer_config.json"
                )
            config = _read_json(config_path) if os.path.isfile(config_path) else {}
            jinja_path = os.path.join(tokenizer_dir, "chat_template.jinja")
            if config.get("chat_template") is not None:
                source = _pick_template(config["chat_template"], config_path)
                name = config_path
            elif os.path.isfile(jinja_path):
                with open(jinja_path, encoding="utf-8") as f:
                    source = f.read()
                name = jinja_path
            else:
                raise ReaderError(
                    f"{tokenizer_dir}: the model has no chat template (no chat_template in tokenizer_config.json, no "
                    "chat_template.jinja): a base model's tokenizer usually has none; pass chat_template='chatml' or "
                    "'llama3', a template string or a file holding one"
                )
            return cls._with_tokens(source, config, tokenizer_dir, name)
        if chat_template.endswith(".json") and os.path.isfile(chat_template):
            config = _read_json(chat_template)
            if config.get("chat_template") is None:
                raise ReaderError(f"{chat_template}: has no chat_template")
            source = _pick_template(config["chat_template"], chat_template)
            return cls._with_tokens(source, config, os.path.dirname(chat_template), chat_template)
        config = _read_json(config_path) if config_path and os.path.isfile(config_path) else {}
        if chat_template.endswith(".jinja") and os.path.isfile(chat_template):
            with open(chat_template, encoding="utf-8") as f:
                return cls._with_tokens(f.read(), config, tokenizer_dir, chat_template)
        if "{{" in chat_template or "{%" in chat_template:
            return cls._with_tokens(chat_template, config, tokenizer_dir, "chat template")
        raise ReaderError(
            f"chat_template {chat_template[:60]!r} is neither built in ({', '.join(BUILT_IN)}), 'model', an existing "
            "tokenizer_config.json or .jinja file, nor a Jinja template"
        )

    @classmethod
    def _with_tokens(cls, source: str, config: dict[str, Any], tokenizer_dir: str | None, name: str) -> ChatTemplate:
        special = {key: text for key in _NAMED_TOKENS if (text := _token_text(config.get(key)))}
        added = {t["content"] for t in config.get("added_tokens_decoder", {}).values() if t.get("special")}
        tokenizer_json = os.path.join(tokenizer_dir, "tokenizer.json") if tokenizer_dir else None
        if tokenizer_json and os.path.isfile(tokenizer_json):
            added |= {t["content"] for t in _read_json(tokenizer_json).get("added_tokens", []) if t.get("special")}
        return cls(source, special, tuple(sorted(added)), name)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        """The text apply_chat_template(messages, tokenize=False, add_generation_prompt=...) gives."""
        return self._template.render(messages=messages, tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt, **self.special_tokens)

    def _render_with_generation_spans(self, messages: list[dict[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
        self._generation.chunks, self._generation.spans = [], []
        try:
            for chunk in self._template.generate(messages=messages, tools=None, documents=None,
                                                 add_generation_prompt=False, **self.special_tokens):
                self._generation.chunks.append(chunk)
            return "".join(self._generation.chunks), list(self._generation.spans)
        finally:
            self._generation.chunks = None

    def render_trained(self, messages: list[dict[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
        """The rendering and the (begin, end) character ranges of it the model learns (see the module doc)."""
        if self.has_generation_blocks:
            return self._render_with_generation_spans(messages)
        text = self.render(messages)
        trained = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self.render(messages[:i], add_generation_prompt=True)
            if not text.startswith(prompt):
                raise ReaderError(
                    f"the template's rendering of messages[:{i}] with the generation prompt is not a prefix of the "
                    f"whole conversation's, so assistant message {i} cannot be located: it renders earlier turns "
                    "differently once more follow; add {% generation %} blocks around what the model learns"
                )
            begin, content = len(prompt), message.get("content")
            if not isinstance(content, str):
                raise ReaderError(f"messages[{i}]: an assistant message's content is a {type(content).__name__}, "
                                  "expected a string")
            end = -1
            for rendered in (content, content.strip()):
                if (at := text.find(rendered, begin)) >= 0:
                    end = at + len(rendered)
                    break
            if end < 0:
                raise ReaderError(f"the template does not write assistant message {i}'s content as it is (nor "
                                  "stripped), so what is learned cannot be located: add {% generation %} blocks")
            after = len(text) - len(text[end:].lstrip())
            for token in self.end_of_turn_tokens:
                if text.startswith(token, after):
                    end = after + len(token)
                    break
            trained.append((begin, end))
        return text, trained

    def render_records(self, records: list[Any]) -> list[tuple[str, list[tuple[int, int]]] | str]:
        """The C++ reader's chat renderer: for each record (a JSON object with "messages"),
        (text, trained character ranges), or the message saying why it cannot be rendered."""
        results: list[tuple[str, list[tuple[int, int]]] | str] = []
        for record in records:
            try:
                results.append(self.render_trained(_messages(record)))
            except ReaderError as error:
                results.append(str(error))
            except jinja2.TemplateError as error:
                results.append(f"{self.name} raised: {error}")
            except (TypeError, ValueError, KeyError, AttributeError, IndexError) as error:
                results.append(f"{self.name} failed on this conversation: {type(error).__name__}: {error}")
        return results


def _messages(record: Any) -> list[dict[str, Any]]:
    """The record's conversation, checked as the C++ reader checks it for the built-in templates."""
    if not isinstance(record, dict):
        raise ReaderError(f"the record is a {_json_type(record)}, expected an object")
    if "messages" not in record:
        raise ReaderError("missing field 'messages'")
    messages = record["messages"]
    if not isinstance(messages, list):
        raise ReaderError(f"field 'messages' is a {_json_type(messages)}, expected an array")
    if not messages:
        raise ReaderError("field 'messages' is empty")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ReaderError(f"messages[{i}] is a {_json_type(message)}, expected an object")
        role = message.get("role")
        if not isinstance(role, str):
            raise ReaderError(f"messages[{i}]: field 'role' is {'missing' if role is None else 'not a string'}")
        if role not in ROLES:
            raise ReaderError(f"messages[{i}]: role '{role}' is not one of {', '.join(ROLES)}")
    if not any(m["role"] == "assistant" for m in messages):
        raise ReaderError("no assistant message: nothing to learn")
    return messages


def _json_type(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number",
            type(None): "null"}.get(type(value), type(value).__name__)


def chat_renderer(chat_template: str, tokenizer_dir: str | os.PathLike[str] | None):
    """The C++ reader's chat_renderer for chat_template: None for a built-in one (C++ renders
    it), else a loaded ChatTemplate's render_records."""
    if chat_template in BUILT_IN:
        return None
    return ChatTemplate.load(chat_template, tokenizer_dir).render_records
