"""barqtrain.get_peft_model: PEFT's get_peft_model, then BarqTrain's patching of the result."""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from torch import nn

from barqtrain.memory.checkpoint import drop_input_require_grads
from barqtrain.patch.families import OPS
from barqtrain.patch.instance import patch_model
from barqtrain.patch.lora import DEFAULT_LORA_PRECISION, checked_precision

if TYPE_CHECKING:
    from peft import PeftConfig, PeftModel

# The attribute of the returned model that holds patch_model's report.
REPORT_ATTRIBUTE = "barqtrain_patch_report"


def get_peft_model(
    model: nn.Module,
    peft_config: PeftConfig | None = None,
    *,
    adapter_name: str = "default",
    autocast_adapter_dtype: bool = True,
    lora_precision: str = DEFAULT_LORA_PRECISION,
    ops: Collection[str] | None = None,
    **lora_options: Any,
) -> PeftModel:
    """peft.get_peft_model(model, peft_config), patched by barqtrain.patch_model (which also
    routes the LoRA layers through barqtrain.lora's functions); its report is the returned
    model's `barqtrain_patch_report`.

    Give either a PEFT config, or LoraConfig's options as keywords (task_type defaults to
    "CAUSAL_LM"): get_peft_model(model, r=16, lora_alpha=32, target_modules="all-linear").
    autocast_adapter_dtype=True (PEFT's default) keeps the adapters of a 16-bit model in
    float32 (master weights, gradients, optimizer states); False keeps them in the model's
    dtype. lora_precision="mixed" (the default) computes the LoRA products in the model's dtype
    on tensor cores, as torch.autocast would; "peft" computes them in the adapters' dtype, PEFT's
    own arithmetic (see docs/lora.md). `ops` as for patch_model (default: all).
    Adapters save and load in PEFT's format (save_pretrained, PeftModel.from_pretrained).
    """
    import peft

    checked_precision(lora_precision)  # before PEFT changes the model
    if peft_config is None:
        peft_config = peft.LoraConfig(**{"task_type": "CAUSAL_LM", **lora_options})
    elif lora_options:
        raise TypeError(
            f"barqtrain: get_peft_model got a peft_config and LoraConfig options ({', '.join(lora_options)}); "
            "give one or the other"
        )
    peft_model = peft.get_peft_model(
        model, peft_config, adapter_name=adapter_name, autocast_adapter_dtype=autocast_adapter_dtype
    )
    # PEFT registers the input-require-grads hook again on a checkpointed model.
    drop_input_require_grads(peft_model)
    report = patch_model(peft_model, ops=OPS if ops is None else ops, lora_precision=lora_precision)
    setattr(peft_model, REPORT_ATTRIBUTE, report)
    return peft_model
