"""BarqTrain: fused CUDA C++ kernels and a lean trainer for fine-tuning Hugging Face models."""

from barqtrain import ops
from barqtrain.patch import PatchReport, patch_model, unpatch_model

__version__ = "0.1.0"

__all__ = ["PatchReport", "ops", "patch_model", "unpatch_model", "__version__"]
