"""`barqtrain train`: a YAML config, a training loop with resumable checkpoints, and an
embedded default (a tiny Llama learning the built-in digit task) that runs anywhere."""

from barqtrain.train.config import ConfigError, TrainConfig, load_config, template_yaml

__all__ = ["ConfigError", "TrainConfig", "load_config", "template_yaml"]
