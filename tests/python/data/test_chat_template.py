"""Chat data rendered with the model's own template (barqtrain.data.chat_template): the text and
ids are transformers' apply_chat_template's; only the assistant turns are learned."""

from __future__ import annotations

import json
import os

import pytest

from shared_data import SHARED, require

from barqtrain.data import DatasetStream, ReaderError, Tokenizer, read_dataset
from barqtrain.data.chat_template import ChatTemplate

transformers = pytest.importorskip("transformers")

TOKENIZERS = {name: SHARED / "tokenizers" / name for name in ("llama3", "qwen2.5")}
# What each template writes for an assistant message: its learned text (content and end of turn).
LEARNED = {"llama3": lambda content: content.strip() + "<|eot_id|>", "qwen2.5": lambda content: content + "<|im_end|>"}

require(*TOKENIZERS.values())

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Japan?\n"},
        {"role": "assistant", "content": "  Tokyo.\n\n"},  # the spaces: llama3 trims, qwen keeps them
    ],
    [
        {"role": "user", "content": "Traduis « bonjour » en 日本語 🙂"},
        {"role": "assistant", "content": "こんにちは — konnichiwa 🙇"},
        {"role": "user", "content": "Ελληνικά;"},
        {"role": "assistant", "content": "Γειά σου"},
    ],
]


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def model(request):
    path = TOKENIZERS[request.param]
    return request.param, path, transformers.AutoTokenizer.from_pretrained(path), Tokenizer.from_file(path)


def write_jsonl(path, conversations):
    path.write_text("".join(json.dumps({"messages": c}, ensure_ascii=False) + "\n" for c in conversations),
                    encoding="utf-8")
    return path


def learned_runs(example):
    """The runs of consecutive learned tokens, each a list of ids; labels equal ids there."""
    runs, previous = [], False
    for token, label in zip(example["input_ids"], example["labels"]):
        if label != -100:
            assert label == token
            if not previous:
                runs.append([])
            runs[-1].append(token)
        previous = label != -100
    return runs


def test_text_ids_and_labels_match_transformers(model, tmp_path):
    name, path, hf, tok = model
    template = ChatTemplate.load("model", path)
    data = read_dataset(write_jsonl(tmp_path / "chat.jsonl", CONVERSATIONS), "messages", path)
    assert len(data) == len(CONVERSATIONS) and data.report["eos_id"] == -1  # the template ends each turn
    for conversation, example in zip(CONVERSATIONS, (data[i] for i in range(len(data)))):
        assert template.render(conversation) == hf.apply_chat_template(conversation, tokenize=False)
        expected = hf.apply_chat_template(conversation, tokenize=True, return_dict=True)["input_ids"]
        assert example["input_ids"] == list(expected)
        assistant = [m["content"] for m in conversation if m["role"] == "assistant"]
        assert [tok.decode(run) for run in learned_runs(example)] == [LEARNED[name](c) for c in assistant]


def test_generation_blocks_mark_what_is_learned_as_transformers_assistant_mask(model, tmp_path):
    _, path, hf, _ = model
    source = (
        "{% for m in messages %}<|{{ m.role }}|>\n{% if m.role == 'assistant' %}{% generation %}"
        "{{ m.content }}{{ eos_token }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}"
    )
    conversation = CONVERSATIONS[1]
    data = read_dataset(write_jsonl(tmp_path / "c.jsonl", [conversation]), "messages", path, chat_template=source)
    out = hf.apply_chat_template(conversation, chat_template=source, tokenize=True, return_dict=True,
                                 return_assistant_tokens_mask=True)
    assert data[0]["input_ids"] == list(out["input_ids"])
    assert [int(label != -100) for label in data[0]["labels"]] == list(out["assistant_masks"])


def test_template_sources_and_a_stream_that_resumes(model, tmp_path):
    _, path, _, _ = model
    config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    template_file = tmp_path / "template.jinja"
    template_file.write_text(config["chat_template"], encoding="utf-8")
    named = dict(config, chat_template=[{"name": "tool_use", "template": "{{ raise_exception('not this') }}"},
                                        {"name": "default", "template": config["chat_template"]}])
    named_path = tmp_path / "tokenizer_config.json"
    named_path.write_text(json.dumps(named), encoding="utf-8")
    chat = write_jsonl(tmp_path / "chat.jsonl", CONVERSATIONS * 4)
    whole = read_dataset(chat, "messages", path)
    for source in (str(template_file), config["chat_template"], str(named_path)):
        again = read_dataset(chat, "messages", path, chat_template=source)
        assert again.tokens.tolist() == whole.tokens.tolist() and again.labels.tolist() == whole.labels.tolist()
    stream = DatasetStream(chat, "messages", path)
    head = stream.read(5)
    resumed = DatasetStream(chat, "messages", path)
    resumed.load_state_dict(stream.state_dict())
    rest = resumed.read(100)
    assert head.tokens.tolist() + rest.tokens.tolist() == whole.tokens.tolist()
    assert head.labels.tolist() + rest.labels.tolist() == whole.labels.tolist()


def test_parquet_rows_render_as_jsonl(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    path = TOKENIZERS["qwen2.5"]
    table = pa.table({"messages": CONVERSATIONS})
    pq.write_table(table, tmp_path / "chat.parquet")
    jsonl = read_dataset(write_jsonl(tmp_path / "chat.jsonl", CONVERSATIONS), "messages", path)
    parquet = read_dataset(tmp_path / "chat.parquet", "messages", path)
    assert parquet.tokens.tolist() == jsonl.tokens.tolist() and parquet.labels.tolist() == jsonl.labels.tolist()


def test_errors_name_the_problem(tmp_path):
    path = TOKENIZERS["qwen2.5"]
    bad_role = [{"role": "human", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    chat = write_jsonl(tmp_path / "bad.jsonl", [CONVERSATIONS[0], bad_role, CONVERSATIONS[0]])
    with pytest.raises(ReaderError, match=rf"^{chat}:2: messages\[0\]: role 'human' is not one of system, user"):
        read_dataset(chat, "messages", path)
    with pytest.warns(UserWarning, match="skipped 1 malformed records of 3"):
        assert len(read_dataset(chat, "messages", path, on_error="skip")) == 2

    raising = "{% if messages[0].role != 'system' %}{{ raise_exception('a system message comes first') }}{% endif %}"
    with pytest.raises(ReaderError, match=rf"^{chat}:1: chat template raised: a system message comes first"):
        read_dataset(chat, "messages", path, chat_template=raising)

    base = tmp_path / "base-model"
    base.mkdir()
    os.symlink(path / "tokenizer.json", base / "tokenizer.json")
    (base / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    with pytest.raises(ReaderError, match="the model has no chat template .* pass chat_template='chatml'"):
        read_dataset(chat, "messages", base)

    last_marked = "{% for m in messages %}{% if loop.last %}[last]{% endif %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    with pytest.raises(ReaderError, match=r"rendering of messages\[:1\] .* is not a prefix of the whole conversation's"):
        read_dataset(chat, "messages", path, chat_template=last_marked)
    with pytest.raises(ReaderError, match="not a valid Jinja template"):
        read_dataset(chat, "messages", path, chat_template="{% for m in messages %}")
    with pytest.raises(ReaderError, match="neither built in .* nor a Jinja template"):
        read_dataset(chat, "messages", path, chat_template="gemma")


def test_tokenize_renders_with_the_model_template(model, tmp_path):
    from barqtrain.cli import main

    name, path, _hf, _tok = model
    data = write_jsonl(tmp_path / "chat.jsonl", CONVERSATIONS)
    out = tmp_path / "shards"
    assert main(["tokenize", str(data), "--tokenizer", str(path), "--format", "messages", "--out", str(out)]) == 0
    expected = read_dataset(data, "messages", path)
    shards = read_dataset(out, "pretokenized", path)
    assert [shards[i] for i in range(len(shards))] == [expected[i] for i in range(len(expected))], name
