"""barqtrain.data.read_dataset on the shared instruction data, and its errors."""

from __future__ import annotations

import json

import pytest

from shared_data import SHARED, require

from barqtrain.data import ReaderError, Tokenizer, read_dataset

QWEN = SHARED / "tokenizers" / "qwen2.5"
ALPACA = SHARED / "instruct" / "llama-factory" / "alpaca_en_demo.json"

require(QWEN, ALPACA)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file(QWEN)


def test_alpaca_prompt_masked_output_learned_eos_appended(tok):
    data = read_dataset(ALPACA, "alpaca", QWEN)
    records = json.loads(ALPACA.read_text(encoding="utf-8"))
    assert len(data) == len(records) and data.report["skipped"] == 0
    eos = tok.encode("<|im_end|>", add_special_tokens=False)[0]  # tokenizer_config.json's eos_token
    assert data.report["eos_id"] == eos
    for i in (0, 7, len(records) - 1):
        r, ex = records[i], data[i]
        learned = [t for t, l in zip(ex["input_ids"], ex["labels"]) if l != -100]
        assert learned == tok.encode(r["output"], add_special_tokens=False) + [eos]
        prompt = [t for t, l in zip(ex["input_ids"], ex["labels"]) if l == -100]
        assert tok.decode(prompt).endswith(r["instruction"] + ("\n\n### Input:\n" + r["input"] if r["input"] else "") + "\n\n### Response:\n")


def test_packs_into_rows(tok):
    data = read_dataset(ALPACA, "alpaca", tok, eos_token="<|endoftext|>")
    packed = data.pack(1024, seed=0)
    assert packed.stats["pieces"] >= len(data) and packed.stats["fill"] > 0.95
    batch = next(iter(data.loader(seq_length=1024, batch_size=2, seed=0)))
    assert tuple(batch.input_ids.shape) == (2, 1024)


def test_chat_messages_with_chatml(tmp_path, tok):
    path = tmp_path / "chat.jsonl"
    path.write_text(
        json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}) + "\n"
    )
    data = read_dataset(path, "messages", tok, chat_template="chatml", add_eos=False)
    ex = data[0]
    assert tok.decode(ex["input_ids"]) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
    assert tok.decode([t for t, l in zip(ex["input_ids"], ex["labels"]) if l != -100]) == "Hello!<|im_end|>"
    with pytest.raises(ReaderError, match="chat_template='model' reads the template from the tokenizer directory"):
        read_dataset(path, "messages", tok)  # the default, the model's template, needs the directory


def test_malformed_lines_raise_or_are_skipped_and_counted(tmp_path, tok):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "a"}\n{"text": \n{"txt": "b"}\n{"text": "c"}\n')
    with pytest.raises(ReaderError, match=rf"^{path}:2: JSON syntax error"):
        read_dataset(path, "text", tok)
    with pytest.warns(UserWarning, match="skipped 2 malformed records of 4"):
        data = read_dataset(path, "text", tok, on_error="skip")
    assert len(data) == 2 and data.report["skipped"] == 2
    assert data.report["errors"][1] == f"{path}:3: missing field 'text'"
    with pytest.raises(ReaderError, match="cannot open"):
        read_dataset(tmp_path / "missing.jsonl", "text", tok)
    with pytest.raises(ReaderError, match="unknown format 'sharegpt'"):
        read_dataset(path, "sharegpt", tok)


def test_plain_text_lines(tok):
    path = SHARED / "text" / "tinyshakespeare" / "input.txt"
    data = read_dataset(path, "text", tok, add_eos=False)
    lines = [l for l in path.read_text(encoding="utf-8").split("\n") if l.strip()]
    assert len(data) == len(lines)
    assert data[5]["input_ids"] == tok.encode(lines[5])


def test_a_stream_resumes_with_the_records_that_came_next(tmp_path, tok):
    from barqtrain.data import DatasetStream

    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(1000)))
    whole = read_dataset(path, "text", tok)
    stream = DatasetStream(path, "text", tok)
    head = stream.read(300)
    state = json.loads(json.dumps(stream.state_dict()))
    resumed = DatasetStream(path, "text", tok)
    resumed.load_state_dict(state)
    chunks = [head] + list(resumed)
    assert [c[i]["input_ids"] for c in chunks for i in range(len(c))] == [whole[i]["input_ids"] for i in range(len(whole))]
    assert resumed.read(10) is None
    path.write_text(path.read_text() + "\n")
    with pytest.raises(ReaderError, match="the file changed"):
        DatasetStream(path, "text", tok).load_state_dict(state)
