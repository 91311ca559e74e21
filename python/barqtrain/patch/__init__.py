"""Patching of Hugging Face models (SPEC T1): their modules computed by BarqTrain's ops.

    report = barqtrain.patch_model(model)   # a PreTrainedModel or a PEFT model
    print(report)
    barqtrain.unpatch_model(model)          # back to the original forwards

ops=(...) patches in only some of OPS: rms_norm, glu (SwiGLU/GeGLU), rope, and
add_rms_norm (the residual add before a decoder layer's second norm).
"""

from barqtrain.patch.families import OPS, SUPPORTED_MODEL_TYPES, UnsupportedModelError
from barqtrain.patch.instance import patch_model, unpatch_model
from barqtrain.patch.report import NotPatched, PatchedOp, PatchReport

__all__ = [
    "OPS",
    "SUPPORTED_MODEL_TYPES",
    "NotPatched",
    "PatchReport",
    "PatchedOp",
    "UnsupportedModelError",
    "patch_model",
    "unpatch_model",
]
