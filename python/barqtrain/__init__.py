"""BarqTrain: fused CUDA C++ kernels and a lean trainer for fine-tuning Hugging Face models."""

from barqtrain import ops

__version__ = "0.1.0"

__all__ = ["ops", "__version__"]
