"""Patching of Hugging Face models: their modules computed by BarqTrain's ops.

Per model (only that model's module instances change):

    report = barqtrain.patch_model(model)   # a PreTrainedModel or a PEFT model
    print(report)
    barqtrain.unpatch_model(model)          # back to the original forwards

Per family (the Hugging Face classes change, so models created afterwards are patched):

    barqtrain.apply_to_llama()              # or apply_to_family("llama")
    barqtrain.revert_class_patches()

Both take ops=(...) to patch in only some of OPS, the default ops: rms_norm, glu
(SwiGLU/GeGLU), rope, add_rms_norm (the residual add before a decoder layer's second norm),
linear_cross_entropy (the training loss of <Family>ForCausalLM without the logits: in
training with labels, its output's logits are None), and lora (PEFT's LoRA Linear layers,
and with them the MLP and the q/k/v projections as single functions; instance patching
only, see lora.py). ALL_OPS adds the opt-in ones (OPT_IN_OPS says why each is): attention,
BarqTrain's attention kernels with RoPE fused in, e.g. ops=(*OPS, "attention") (see
docs/attention.md).

TRL's SFTTrainer computes its loss with its own fused LM head, not the causal-LM forward:
patch_sft_trainer(trainer), once the trainer is built, computes it with
linear_cross_entropy's op instead (see trl_sft.py and docs/hf_trainer.md).
"""

from barqtrain.patch.classes import (
    apply_to_family,
    apply_to_gemma,
    apply_to_gemma2,
    apply_to_gemma3,
    apply_to_llama,
    apply_to_mistral,
    apply_to_phi3,
    apply_to_qwen2,
    apply_to_qwen3,
    revert_class_patches,
)
from barqtrain.patch.families import (
    ALL_OPS,
    FAMILIES,
    OPS,
    OPT_IN_OPS,
    SUPPORTED_MODEL_TYPES,
    UnsupportedModelError,
)
from barqtrain.patch.attention import set_shifted_sparse_attention
from barqtrain.patch.instance import patch_model, unpatch_model
from barqtrain.patch.report import ClassNotPatched, ClassPatchReport, NotPatched, PatchedOp, PatchReport
from barqtrain.patch.trl_sft import patch_sft_trainer

__all__ = [
    "ALL_OPS",
    "FAMILIES",
    "OPS",
    "OPT_IN_OPS",
    "SUPPORTED_MODEL_TYPES",
    "ClassNotPatched",
    "ClassPatchReport",
    "NotPatched",
    "PatchReport",
    "PatchedOp",
    "UnsupportedModelError",
    "apply_to_family",
    "apply_to_gemma",
    "apply_to_gemma2",
    "apply_to_gemma3",
    "apply_to_llama",
    "apply_to_mistral",
    "apply_to_phi3",
    "apply_to_qwen2",
    "apply_to_qwen3",
    "patch_model",
    "patch_sft_trainer",
    "revert_class_patches",
    "set_shifted_sparse_attention",
    "unpatch_model",
]
