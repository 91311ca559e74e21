"""`barqtrain generate`: the patched stories260K Llama, with its KV cache, generates the greedy
tokens of the unpatched Transformers model and of a cache-free argmax loop; sampling repeats
with its seed and is Transformers' own sampling; generation stops at the stop tokens; --chat
renders the prompt as apply_chat_template does, with the model's template or a built-in one;
the text is streamed as the tokens come, multi-byte characters split over tokens written whole."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from shared_data import SHARED, require  # noqa: E402

from gguf_models import tiny_model  # noqa: E402

from barqtrain.cli import main  # noqa: E402
from barqtrain.data import Tokenizer  # noqa: E402
from barqtrain.ops.attention import kernel_unsupported_reason  # noqa: E402
from barqtrain.train.generate_command import Sampling, TextStream, generate, prompt_ids, stop_ids  # noqa: E402
from barqtrain.train.inference import LoadedModel, load_model  # noqa: E402

STORIES = SHARED / "models" / "stories260K-hf"
TOKENIZERS = SHARED / "tokenizers"
BYTE_LEVEL = ("gpt2", "llama3", "qwen2.5")
require(STORIES / "model.safetensors", *(TOKENIZERS / name / "tokenizer.json" for name in BYTE_LEVEL))
PROMPTS = ("Once upon a time", "The little dog", "Lily and Tom went to the park")
CPU = torch.device("cpu")
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def patched():
    return load_model(STORIES, CPU, log=lambda *a: None)


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32).eval()


def _encode(text: str) -> list[int]:
    return Tokenizer.from_file(str(STORIES)).encode(text)


@torch.no_grad()
def _argmax_without_cache(model, ids: list[int], steps: int) -> list[int]:
    ids = list(ids)
    for _ in range(steps):
        ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_are_the_unpatched_models(patched, hf_model, prompt):
    ids = _encode(prompt)
    new = generate(patched.model, ids, [], Sampling(max_new_tokens=NEW_TOKENS))
    reference = hf_model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0, len(ids):].tolist()
    assert new == reference


def test_greedy_tokens_with_the_kv_cache_are_a_cache_free_argmax_loops(patched, hf_model):
    ids = _encode(PROMPTS[2])
    assert ids + generate(patched.model, ids, [], Sampling(NEW_TOKENS)) == _argmax_without_cache(hf_model, ids,
                                                                                                 NEW_TOKENS)


def test_sampling_repeats_with_its_seed_and_is_transformers_sampling(patched, hf_model):
    ids = _encode(PROMPTS[0])
    sampling = Sampling(max_new_tokens=NEW_TOKENS, temperature=0.9, top_p=0.95, top_k=50, seed=7)
    first = generate(patched.model, ids, [], sampling)
    assert generate(patched.model, ids, [], sampling) == first
    torch.manual_seed(7)
    reference = hf_model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=True, temperature=0.9,
                                  top_p=0.95, top_k=50, eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert first == reference
    others = {tuple(generate(patched.model, ids, [], Sampling(NEW_TOKENS, 0.9, 0.95, 50, seed))) for seed in (1, 2)}
    assert len(others | {tuple(first)}) > 1


def test_stops_before_a_stop_token(patched):
    ids = _encode(PROMPTS[1])
    free = generate(patched.model, ids, [], Sampling(max_new_tokens=30))
    stop = free[5]
    first = free.index(stop)  # the stop token's first occurrence, at most 5
    assert generate(patched.model, ids, [stop], Sampling(max_new_tokens=30)) == free[:first]


def test_stop_ids_include_the_generation_configs_eos(patched):
    assert stop_ids(patched) == [2]  # stories260K's </s>


def test_chat_prompt_is_apply_chat_templates(tmp_path, patched):
    from transformers import AutoTokenizer

    model_dir = tmp_path / "chat-model"
    shutil.copytree(STORIES, model_dir)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = load_model(model_dir, CPU, log=lambda *a: None)
    ids, end_of_turn = prompt_ids(loaded, "Tell me a story", chat=True, chat_template=None)
    messages = [{"role": "user", "content": "Tell me a story"}]
    expected = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(messages, add_generation_prompt=True,
                                                                           tokenize=True, return_dict=False)
    assert ids == list(expected)
    assert "</s>" in end_of_turn and stop_ids(loaded, end_of_turn) == [2]


# The plain ChatML template (Qwen 2.5's own adds a default system prompt, which the built-in does not).
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHAT_PROMPTS = ("Tell me a story", "  two leading spaces,\ttabs\nand a new line ", "naïve café, 東京 🙂")


def _llama3_adding_bos(directory: Path) -> Path:
    """The llama3 tokenizer with the post-processor of Meta's tokenizer.json, which adds
    <|begin_of_text|> (the shared copy's adds nothing); its tokenizer_config has Meta's template."""
    tokenizer = json.loads((TOKENIZERS / "llama3" / "tokenizer.json").read_text())
    bos = "<|begin_of_text|>"
    tokenizer["post_processor"] = {"type": "Sequence", "processors": [tokenizer["post_processor"], {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [128000], "tokens": [bos]}},
    }]}
    directory.mkdir()
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    shutil.copy(TOKENIZERS / "llama3" / "tokenizer_config.json", directory)
    return directory


@pytest.mark.parametrize("prompt", CHAT_PROMPTS)
@pytest.mark.parametrize(("name", "jinja"), [("chatml", CHATML), ("llama3", None)])
def test_built_in_chat_prompt_is_apply_chat_templates(tmp_path, name, jinja, prompt):
    """The data reader's chatml and llama3 (the run's data.chat_template, or --chat-template):
    the tokens it puts before a reply, against Transformers rendering ChatML with Qwen 2.5's
    tokenizer, and Meta's Llama 3 template with Llama 3's."""
    from transformers import AutoTokenizer

    tokenizer_dir = TOKENIZERS / "qwen2.5" if name == "chatml" else _llama3_adding_bos(tmp_path / "llama3")
    run = LoadedModel(model=None, tokenizer_dir=tokenizer_dir, data={"chat_template": name}, end_token=None,
                      description="a run")
    ids, end_of_turn = prompt_ids(run, prompt, chat=True, chat_template=None)
    messages = [{"role": "user", "content": prompt}]
    expected = AutoTokenizer.from_pretrained(tokenizer_dir).apply_chat_template(
        messages, chat_template=jinja, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids == list(expected)
    assert end_of_turn == ({"chatml": "<|im_end|>", "llama3": "<|eot_id|>"}[name],)


class _Writes:
    """An output stream that keeps each write."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> None:
        self.writes.append(text)

    def flush(self) -> None:
        pass


STREAMED_TEXT = "naïve café, 東京の空 🙂🎉 — ok"


@pytest.mark.parametrize("name", ["stories260K", *BYTE_LEVEL])
def test_stream_writes_whole_characters_as_the_tokens_come(name):
    """SentencePiece byte fallback (stories260K has no token for 東) and byte-level BPE split
    characters over tokens; the stream writes each character once its last byte has come."""
    tokenizer_dir = STORIES if name == "stories260K" else TOKENIZERS / name
    tokenizer = Tokenizer.from_file(str(tokenizer_dir))
    ids = tokenizer.encode(STREAMED_TEXT, add_special_tokens=False)
    assert any(tokenizer.decode(ids[:n]).endswith("\ufffd") for n in range(1, len(ids)))  # a character is split
    out = _Writes()
    stream = TextStream(tokenizer_dir, stops=[], out=out)
    stream.put(torch.tensor([[1, 2, 3]]))  # the prompt: not written
    written_before_end = []
    for token in ids:
        stream.put(torch.tensor([token]))
        written_before_end.append("".join(out.writes))
    stream.end()
    decoded = tokenizer.decode(ids)
    assert "".join(out.writes) == decoded
    assert 0 < len(written_before_end[len(ids) // 2]) < len(decoded)  # written as it came
    assert written_before_end[-1] == decoded  # nothing was left for end()
    assert not any("\ufffd" in text for text in out.writes)


def test_stream_of_bytes_that_are_not_utf8_is_the_decoded_text():
    """A run of byte tokens that is not UTF-8 decodes as a U+FFFD per byte, a valid byte (G) included:
    the stream writes none of the run until a token ends it (a model's output can be any bytes)."""
    vocab = json.loads((STORIES / "tokenizer.json").read_text())["model"]["vocab"]
    tokenizer = Tokenizer.from_file(str(STORIES))
    invalid_run = [vocab["<0x47>"], vocab["<0xE2>"], vocab["<0x41>"]]  # G, a 3-byte lead, A
    ids = tokenizer.encode("Once upon", add_special_tokens=False) + invalid_run + tokenizer.encode(
        " a time", add_special_tokens=False) + invalid_run[:2]
    out = _Writes()
    stream = TextStream(STORIES, stops=[], out=out)
    stream.put(torch.tensor([[1]]))
    for token in ids:
        stream.put(torch.tensor([token]))
    stream.end()
    assert "".join(out.writes) == tokenizer.decode(ids)
    assert "\ufffd\ufffd\ufffd" in tokenizer.decode(ids)  # the run's G too


def test_stream_ends_at_the_first_stop_token():
    tokenizer = Tokenizer.from_file(str(STORIES))
    ids = tokenizer.encode("Once upon a time there was a dog", add_special_tokens=False)
    out = _Writes()
    stream = TextStream(STORIES, stops=[ids[4]], out=out)
    stream.put(torch.tensor([[1]]))
    for token in ids:
        stream.put(torch.tensor([token]))
    stream.end()
    assert "".join(out.writes) == tokenizer.decode(ids[:ids.index(ids[4])])


def test_generate_streams_the_tokens_it_returns(patched):
    out = _Writes()
    new = generate(patched.model, _encode(PROMPTS[0]), [2], Sampling(max_new_tokens=20),
                   streamer=TextStream(STORIES, [2], out))
    assert "".join(out.writes) == Tokenizer.from_file(str(STORIES)).decode(new, skip_special_tokens=True)
    assert len(out.writes) > 10


def test_cli_prints_the_greedy_continuation(capsys, patched):
    assert main(["generate", str(STORIES), "--prompt", PROMPTS[0], "--max-new-tokens", "20"]) == 0
    new = generate(patched.model, _encode(PROMPTS[0]), [2], Sampling(max_new_tokens=20))
    assert capsys.readouterr().out == Tokenizer.from_file(str(STORIES)).decode(new, skip_special_tokens=True) + "\n"


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--chat"], "has no chat template"),
        (["--chat", "--chat-template", "chatml"], "the template ends a turn with '<|im_end|>', which is not one token"),
        (["--temperature", "-1"], "--temperature -1.0: must be 0 (greedy) or above"),
        (["--top-p", "0"], "--top-p 0.0: must be in (0, 1]"),
    ],
)
def test_errors_are_one_line(capsys, arguments, message):
    assert main(["generate", str(STORIES), "--prompt", "Hi", *arguments]) == 2
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1


@pytest.fixture(scope="module")
def patched_gpu():
    return load_model(STORIES, torch.device("cuda"), log=lambda *a: None).model


@pytest.mark.gpu
@pytest.mark.parametrize("prompt", PROMPTS)
def test_patched_model_on_the_gpu_generates_the_unpatched_models_greedy_tokens(patched_gpu, hf_model, prompt):
    """stories260K in fp32, its dtype: BarqTrain's norm and SwiGLU kernels compute the prompt
    (its attention, head_dim 8 in fp32, is PyTorch's), the KV cache the steps after it."""
    assert patched_gpu.device.type == "cuda"
    ids = _encode(prompt)
    expected = _argmax_without_cache(hf_model, ids, NEW_TOKENS)[len(ids):]
    assert generate(patched_gpu, ids, [], Sampling(max_new_tokens=NEW_TOKENS)) == expected


# bf16's rounding moves these logits by up to 0.04 (measured on the CPU); a token the kernels
# got wrong would be ~2.3 below the top (the median gap over the vocabulary).
BF16_LOGIT_TOLERANCE = 0.15


@pytest.mark.gpu
def test_patched_bf16_model_on_the_gpu_generates_the_likeliest_tokens(tmp_path):
    """A small Llama in bf16 with head_dim 64, whose prompt BarqTrain's attention kernel computes
    (fused RoPE): each greedy token is, within bf16's rounding, the likeliest one of the float32
    model with the same weights given the tokens before it; the stream (which generate feeds a
    step late on the GPU) writes the text of the tokens generated."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model(tmp_path / "llama", "llama")
    AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).save_pretrained(model_dir)
    patched = load_model(model_dir, torch.device("cuda"), log=lambda *a: None).model
    config = patched.config
    assert patched.dtype == torch.bfloat16
    q = torch.empty(1, 16, config.num_attention_heads, config.head_dim, device="cuda", dtype=torch.bfloat16)
    assert kernel_unsupported_reason(q, rotary_dim=config.head_dim, needs_grad=False) is None
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = Tokenizer.from_file(str(STORIES))
    for prompt in PROMPTS:
        ids = _encode(prompt)
        out = _Writes()
        new = generate(patched, ids, [], Sampling(max_new_tokens=NEW_TOKENS), TextStream(STORIES, [], out))
        assert "".join(out.writes) == tokenizer.decode(new, skip_special_tokens=True)
        with torch.no_grad():
            logits = reference(torch.tensor([ids + new])).logits[0, len(ids) - 1:-1]
        below_top = logits.max(dim=1).values - logits.gather(1, torch.tensor(new)[:, None])[:, 0]
        assert below_top.max() < BF16_LOGIT_TOLERANCE, prompt
