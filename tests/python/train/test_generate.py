"""`barqtrain generate`: the patched stories260K Llama, with its KV cache, generates the greedy
tokens of the unpatched Transformers model and of a cache-free argmax loop; sampling repeats
with its seed and is Transformers' own sampling; generation stops at the stop tokens; --chat
renders the prompt as apply_chat_template does."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
from shared_data import SHARED, require  # noqa: E402

from barqtrain.cli import main  # noqa: E402
from barqtrain.data import Tokenizer  # noqa: E402
from barqtrain.train.generate_command import Sampling, generate, prompt_ids, stop_ids  # noqa: E402
from barqtrain.train.inference import load_model  # noqa: E402

STORIES = SHARED / "models" / "stories260K-hf"
require(STORIES / "model.safetensors")
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


def test_cli_prints_the_greedy_continuation(capsys, patched):
    assert main(["generate", str(STORIES), "--prompt", PROMPTS[0], "--max-new-tokens", "20"]) == 0
    new = generate(patched.model, _encode(PROMPTS[0]), [2], Sampling(max_new_tokens=20))
    assert capsys.readouterr().out == Tokenizer.from_file(str(STORIES)).decode(new, skip_special_tokens=True) + "\n"


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--chat"], "has no chat template"),
        (["--temperature", "-1"], "--temperature -1.0: must be 0 (greedy) or above"),
        (["--top-p", "0"], "--top-p 0.0: must be in (0, 1]"),
    ],
)
def test_errors_are_one_line(capsys, arguments, message):
    assert main(["generate", str(STORIES), "--prompt", "Hi", *arguments]) == 2
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1


@pytest.mark.gpu
@pytest.mark.parametrize("prompt", PROMPTS)
def test_patched_model_on_the_gpu_generates_the_unpatched_models_greedy_tokens(hf_model, prompt):
    """BarqTrain's CUDA kernels compute the prompt (fp32, stories260K's dtype), the KV cache the steps after it."""
    gpu = torch.device("cuda")
    patched_gpu = load_model(STORIES, gpu, log=lambda *a: None).model
    assert patched_gpu.device.type == "cuda"
    ids = _encode(prompt)
    expected = _argmax_without_cache(hf_model, ids, NEW_TOKENS)[len(ids):]
    assert generate(patched_gpu, ids, [], Sampling(max_new_tokens=NEW_TOKENS)) == expected
