"""The end-to-end workloads: each builds the model family and shape it names."""

import pytest
import torch

from barqtrain.train import shapes
from barqtrain_bench.models import BENCHMARK_MODELS, LLAMA_1B, LLAMA_8B, SELECTABLE_MODELS, WORKLOADS, build_model

# Parameter counts of the published checkpoints (tied embeddings counted once).
PARAMETERS = {
    "llama-1b": ("LlamaForCausalLM", 1_235_814_400),
    "llama-8b": ("LlamaForCausalLM", 8_030_261_248),
    "qwen2.5-1.5b": ("Qwen2ForCausalLM", 1_543_714_304),
    "gemma2-2b": ("Gemma2ForCausalLM", 2_614_341_888),
}


@pytest.mark.parametrize("name", list(PARAMETERS))
def test_each_workload_builds_its_checkpoints_shape(name):
    model = build_model(WORKLOADS[name], torch.device("meta"))  # shapes only, no memory
    model_class, parameters = PARAMETERS[name]
    assert type(model).__name__ == model_class
    assert sum(parameter.numel() for parameter in model.parameters()) == parameters
    assert model.config.use_cache is False and model.config._attn_implementation == "sdpa"


def test_the_qwen_and_gemma_specifics_reach_the_config():
    qwen = build_model(WORKLOADS["qwen2.5-1.5b"], torch.device("meta"))
    assert qwen.model.layers[0].self_attn.q_proj.bias is not None
    assert qwen.config.rope_parameters["rope_theta"] == 1e6 and qwen.config.tie_word_embeddings
    gemma = build_model(WORKLOADS["gemma2-2b"], torch.device("meta"))
    config = gemma.config
    assert (config.head_dim, config.query_pre_attn_scalar, config.sliding_window) == (256, 256, 4096)
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (50.0, 30.0)
    assert config.hidden_activation == "gelu_pytorch_tanh"


def test_the_default_models_stay_the_llama_shapes():
    assert BENCHMARK_MODELS == ("llama-1b", "llama-8b")
    assert set(SELECTABLE_MODELS) == set(PARAMETERS)


def test_the_llama_workloads_are_the_trainers_named_shapes():
    # `barqtrain train` with model.name llama-1b-shape / llama-8b-shape builds these same shapes.
    assert LLAMA_1B.config == shapes.LLAMA_3_2_1B and LLAMA_8B.config == shapes.LLAMA_3_1_8B
