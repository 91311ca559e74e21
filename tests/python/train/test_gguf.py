"""GGUF export without llama.cpp: BarqTrain's Q4_K/Q6_K blocks dequantize (by the gguf
package's own reader) to the values they encode; the file of the real stories260K Llama holds
its tokenizer, hyperparameters and weights (q/k permuted as llama.cpp's converter does); every
family writes every type under llama.cpp's tensor names; a LoRA run exports merged; the
errors a user can cause are one line. test_gguf_llama_cpp.py has llama.cpp run the files."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="GGUF export needs the gguf package (requirements-dev.txt installs it)")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf_models import FAMILIES, STORIES, tiny_model  # noqa: E402
from shared_data import require  # noqa: E402

from barqtrain.cli import main  # noqa: E402
from barqtrain.train.export import ExportError  # noqa: E402
from barqtrain.train.export_command import export_gguf  # noqa: E402
from barqtrain.train.gguf_export import GGUF_TYPES, write_gguf  # noqa: E402
from barqtrain.train.kquants import quantize_q4_k, quantize_q5_k, quantize_q6_k  # noqa: E402

require(STORIES / "model.safetensors")
Type = gguf.GGMLQuantizationType
QUIET = dict(log=lambda *a, **k: None)


def _fields(path: Path) -> dict:
    reader = gguf.GGUFReader(path)
    return {name: field.contents() for name, field in reader.fields.items()}


def _tensors(path: Path) -> dict[str, tuple[np.ndarray, object]]:
    reader = gguf.GGUFReader(path)
    return {t.name: (gguf.quants.dequantize(t.data, t.tensor_type), t.tensor_type) for t in reader.tensors}


# ------------------------------------------------------------------------------ K-quants


@pytest.mark.parametrize(
    ("quantize", "qtype", "relative_rms"),  # measured on these rows: 0.077, 0.038, 0.019
    [(quantize_q4_k, Type.Q4_K, 0.09), (quantize_q5_k, Type.Q5_K, 0.045), (quantize_q6_k, Type.Q6_K, 0.025)],
)
def test_k_quant_blocks_dequantize_within_a_code_step(quantize, qtype, relative_rms):
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((6, 512)).astype(np.float32) * np.linspace(0.01, 3.0, 6, dtype=np.float32)[:, None]
    rows[0, :256] = 0.0  # an all-zero super-block
    rows[1] = np.abs(rows[1])  # no negative value: Q4_K/Q5_K's min is 0
    blocks = quantize(rows)
    assert blocks.dtype == np.uint8 and blocks.shape == (6, 2 * gguf.GGML_QUANT_SIZES[qtype][1])
    restored = gguf.quants.dequantize(blocks, qtype)
    # One code step of each sub-block (an affine grid over [min(0, low), high] of 16 or 32
    # codes; Q6_K's symmetric one of 63 over [-max|x|, max|x|]), plus its scale's rounding.
    if qtype == Type.Q6_K:
        sub_block = 16
        spans = rows.reshape(6, -1, sub_block)
        step = np.abs(spans).max(-1) / 31
    else:
        sub_block = 32
        spans = rows.reshape(6, -1, sub_block)
        step = (spans.max(-1) - np.minimum(spans.min(-1), 0)) / (15 if qtype == Type.Q4_K else 31)
    error = np.abs(restored - rows).reshape(6, -1, sub_block).max(-1)
    assert np.all(error <= 1.05 * step + 1e-7)
    assert np.all(restored[0, :256] == 0)
    relative = np.sqrt(((restored - rows) ** 2).mean() / (rows**2).mean())
    assert relative < relative_rms


def test_k_quant_rows_must_hold_whole_super_blocks():
    with pytest.raises(ValueError, match="not a whole number of 256-value super-blocks"):
        quantize_q4_k(np.zeros((2, 64), np.float32))


# -------------------------------------------------------------------- stories260K's file


@pytest.fixture(scope="module")
def stories_f16(tmp_path_factory) -> Path:
    return write_gguf(STORIES, tmp_path_factory.mktemp("gguf") / "stories.gguf", "f16", **QUIET)


def test_tokenizer_and_hyperparameters(stories_f16):
    fields = _fields(stories_f16)
    tokenizer = json.loads((STORIES / "tokenizer.json").read_text())
    vocab = sorted(tokenizer["model"]["vocab"].items(), key=lambda item: item[1])
    assert fields["general.architecture"] == "llama"
    assert fields["tokenizer.ggml.model"] == "llama"  # SentencePiece-style: BPE with byte fallback and "▁"
    assert fields["tokenizer.ggml.tokens"] == [text for text, _ in vocab]
    assert fields["tokenizer.ggml.token_type"][3:259] == [int(gguf.TokenType.BYTE)] * 256  # <0x00>..<0xFF>
    assert fields["tokenizer.ggml.token_type"][1:3] == [int(gguf.TokenType.CONTROL)] * 2  # <s>, </s>
    # The score of a token is minus the rank of the merge that makes it: the first merge scores highest.
    first = "".join(tokenizer["model"]["merges"][0])  # a [left, right] pair
    assert fields["tokenizer.ggml.scores"][tokenizer["model"]["vocab"][first]] == -1.0
    assert (fields["tokenizer.ggml.bos_token_id"], fields["tokenizer.ggml.eos_token_id"]) == (1, 2)
    assert fields["tokenizer.ggml.add_bos_token"] is True and fields["tokenizer.ggml.add_space_prefix"] is True
    config = json.loads((STORIES / "config.json").read_text())
    assert fields["llama.embedding_length"] == config["hidden_size"]
    assert fields["llama.block_count"] == config["num_hidden_layers"]
    assert fields["llama.attention.head_count_kv"] == config["num_key_value_heads"]
    assert fields["llama.rope.dimension_count"] == config["head_dim"]
    assert fields["llama.rope.freq_base"] == pytest.approx(config["rope_parameters"]["rope_theta"])
    assert fields["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_F16)


def test_weights_are_the_models_with_q_and_k_rows_interleaved(stories_f16):
    from safetensors.torch import load_file

    weights = load_file(STORIES / "model.safetensors")
    tensors = _tensors(stories_f16)
    assert "output.weight" not in tensors  # tied: llama.cpp reads token_embd
    embedding, kind = tensors["token_embd.weight"]
    assert kind == Type.F16
    np.testing.assert_allclose(embedding, weights["model.embed_tokens.weight"].numpy(), atol=1e-3, rtol=1e-3)
    norm, kind = tensors["blk.0.attn_norm.weight"]
    assert kind == Type.F32 and np.array_equal(norm, weights["model.layers.0.input_layernorm.weight"].numpy())
    # Head h's row pairs (i, i + head_dim / 2) of Hugging Face's rotate-half become rows (2i, 2i + 1).
    query = weights["model.layers.0.self_attn.q_proj.weight"].numpy()
    head_dim = 8
    stored = tensors["blk.0.attn_q.weight"][0].reshape(8, head_dim, -1)
    heads = query.reshape(8, head_dim, -1)
    for i in range(head_dim // 2):
        np.testing.assert_allclose(stored[:, 2 * i], heads[:, i], atol=1e-3, rtol=1e-3)
        np.testing.assert_allclose(stored[:, 2 * i + 1], heads[:, i + head_dim // 2], atol=1e-3, rtol=1e-3)


def test_chat_template_and_the_trained_end_of_turn_token(tmp_path):
    """A model directory as `barqtrain export` writes it for a chat run: the template in
    tokenizer_config.json, the end-of-turn token added to the generation config's EOS."""
    model_dir = tmp_path / "chat"
    model_dir.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (model_dir / name).write_bytes((STORIES / name).read_bytes())
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    config = json.loads((STORIES / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    (model_dir / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 13]}))
    fields = _fields(write_gguf(model_dir, tmp_path / "chat.gguf", "f16", **QUIET))
    assert fields["tokenizer.chat_template"] == template
    assert (fields["tokenizer.ggml.eos_token_id"], fields["tokenizer.ggml.eot_token_id"]) == (2, 13)


def test_q8_0_keeps_rows_it_cannot_block_in_f16_and_says_so(tmp_path):
    lines = []
    path = write_gguf(STORIES, tmp_path / "q8.gguf", "q8_0", log=lines.append)
    tensors = _tensors(path)
    assert tensors["blk.0.attn_q.weight"][1] == Type.Q8_0  # rows of 64
    assert tensors["blk.0.ffn_down.weight"][1] == Type.F16  # rows of 172
    assert len(lines) == 1 and "5 weights whose rows are not a multiple of 32" in lines[0]


# ----------------------------------------------------------------------- every family


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {family: tiny_model(root / family, family) for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_writes_every_type(family_dirs, family, tmp_path):
    from safetensors.torch import load_file

    expected = {
        "llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "gemma": "gemma",
        "gemma2": "gemma2", "gemma3_text": "gemma3",
    }[family]
    tied = family.startswith("gemma")  # llama.cpp reads a tied output projection from token_embd
    hf_count = len([n for n in load_file(family_dirs[family] / "model.safetensors") if not (tied and "lm_head" in n)])
    for gguf_type in GGUF_TYPES:
        path = write_gguf(family_dirs[family], tmp_path / f"{gguf_type}.gguf", gguf_type, **QUIET)
        assert _fields(path)["general.architecture"] == expected
        tensors = _tensors(path)
        assert len(tensors) == hf_count
        assert {"token_embd.weight", "output_norm.weight", "blk.1.ffn_down.weight"} <= set(tensors)
        if gguf_type == "q4_k_m":  # llama.cpp's Q4_K_M mix: Q6_K where a layer's values matter most
            assert tensors["blk.1.ffn_down.weight"][1] == Type.Q6_K  # the last eighth of the layers
            assert tensors["blk.0.ffn_down.weight"][1] == Type.Q4_K
            if family == "phi3":
                assert tensors["blk.0.attn_qkv.weight"][1] == Type.Q5_K
            assert tensors["blk.0.ffn_up.weight"][1] == Type.Q4_K
    if family.startswith("gemma"):  # (1 + weight) norms stored as llama.cpp multiplies them
        weights = load_file(family_dirs[family] / "model.safetensors")
        np.testing.assert_allclose(tensors["output_norm.weight"][0], weights["model.norm.weight"].numpy() + 1)


def test_lora_run_exports_its_merged_model(tmp_path, capsys):
    import peft
    import yaml
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["v_proj"],
                                                      init_lora_weights=False))
    run = tmp_path / "run"
    model.save_pretrained(run / "adapter")
    (run / "config.yaml").write_text(yaml.safe_dump({"method": "lora", "model": {"path": str(STORIES)}}))
    merged_v = model.merge_and_unload().model.layers[2].self_attn.v_proj.weight.detach().numpy()

    assert main(["export", str(run), "--gguf", "f16"]) == 0
    assert f"Wrote {run / 'model-f16.gguf'} (f16" in capsys.readouterr().out
    stored = _tensors(run / "model-f16.gguf")["blk.2.attn_v.weight"][0]
    np.testing.assert_allclose(stored, merged_v, atol=1e-3, rtol=1e-3)
    assert not [p for p in run.iterdir() if p.name.startswith(".")]  # the temporary merge is gone


def test_q4_k_m_of_rows_it_cannot_hold_is_a_one_line_error(tmp_path, capsys):
    assert main(["export", str(STORIES), "--gguf", "q4_k_m", "--out", str(tmp_path / "m.gguf")]) == 2
    error = capsys.readouterr().err
    assert error == (
        "barqtrain export: --gguf q4_k_m: weight token_embd.weight [512, 64] has rows of 64 values, not a multiple "
        "of the 256 a K-quant block holds; export this model as q8_0 (or f16/bf16)\n"
    )
    assert not list(tmp_path.iterdir())


def test_model_and_file_errors(tmp_path, family_dirs):
    out = tmp_path / "m.gguf"
    out.write_text("not GGUF")
    with pytest.raises(ExportError, match="exists; give a new file, or pass --overwrite"):
        export_gguf(STORIES, "f16", out, **QUIET)
    with pytest.raises(ExportError, match="not a GGUF file, so --overwrite leaves it alone"):
        export_gguf(STORIES, "f16", out, overwrite=True, **QUIET)
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        (no_tokenizer / name).write_bytes((STORIES / name).read_bytes())
    with pytest.raises(ExportError, match="no tokenizer.json"):
        write_gguf(no_tokenizer, tmp_path / "a.gguf", "f16", **QUIET)
    config = json.loads((family_dirs["llama"] / "config.json").read_text())
    unknown = tmp_path / "starcoder"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "starcoder2",
                                                     "architectures": ["Starcoder2ForCausalLM"]}))
    with pytest.raises(ExportError, match="model_type 'starcoder2' has no GGUF export; the families exported are"):
        write_gguf(unknown, tmp_path / "b.gguf", "f16", **QUIET)
    assert not list(tmp_path.glob("*.gguf*"))[1:]  # only m.gguf, nothing half-written


@pytest.mark.parametrize(
    ("family", "change", "message"),
    [
        ("qwen2", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                       "original_max_position_embeddings": 64, "truncate": False}},
         "config.json: rope_parameters.truncate false has no GGUF export for qwen2: llama.cpp's YaRN rounds the ramp's "
         "ends (truncate true); the llama and mistral exports carry it"),
        ("gemma2", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                        "original_max_position_embeddings": 64}},
         "config.json: rope_parameters.rope_type 'yarn' has no GGUF export for gemma2: llama.cpp's graph for it reads "
         "no frequency factors (default, linear, dynamic do)"),
        ("qwen3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 32,
                                       "long_factor": [2.0] * 32, "original_max_position_embeddings": 64}},
         "config.json: rope_parameters.rope_type 'longrope' has no GGUF export for qwen3: llama.cpp's graph for it "
         "reads no frequency factors (default, linear, dynamic, yarn do)"),
        ("gemma3_text", {"rope_parameters": {
            "full_attention": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                               "original_max_position_embeddings": 64, "attention_factor": 1.3},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
         "config.json: rope_parameters.full_attention: a YaRN cos/sin scale of 1.3 (attention_factor, mscale) has no "
         "GGUF export for gemma3_text: llama.cpp scales the sliding-window layers by it too; only 0.1 ln(factor) + 1 "
         "= 1.13863 exports"),
        ("gemma3_text", {"rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "sliding_attention": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}},
         "config.json: rope_parameters.sliding_attention.rope_type 'linear' has no GGUF export for gemma3_text: "
         "llama.cpp turns the sliding-window layers by the default RoPE on their own rope_theta"),
        ("llama", {"rope_parameters": {"rope_type": "proportional", "rope_theta": 10000.0}},
         "config.json: rope_parameters.rope_type 'proportional' has no GGUF export (default, linear, dynamic, yarn, "
         "llama3, longrope do)"),
        ("gemma2", {"query_pre_attn_scalar": 32},
         "config.json: query_pre_attn_scalar 32 is not the 64 llama.cpp uses for a 2-layer gemma2; no GGUF export"),
    ],
)
def test_configs_llama_cpp_would_run_differently_are_refused(tmp_path, family_dirs, family, change, message):
    model_dir = tmp_path / family
    model_dir.mkdir()
    for path in family_dirs[family].iterdir():
        if path.is_file():
            (model_dir / path.name).write_bytes(path.read_bytes())
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ExportError) as error:
        write_gguf(model_dir, tmp_path / "m.gguf", "f16", **QUIET)
    assert str(error.value) == message
    assert not list(tmp_path.glob("*.gguf*"))
