"""Gated-MLP replacements: down(act(gate) * up) with act(gate) * up computed by
barqtrain.ops.glu (SwiGLU or GeGLU).

The projections are the module's own layers, called, so that PEFT LoRA layers and quantized
linears in their place keep working; except where they are LoRA layers patched by BarqTrain
(and plain nn.Linear): then the whole MLP is one barqtrain.lora.lora_gated_mlp, which stores
less for the backward than the layers would one by one.

Either forward runs a tile of tokens at a time when the MLP has a tile size
(barqtrain.memory.set_mlp_tile_tokens): its intermediates then never exist for the whole sequence.
"""

from __future__ import annotations

import torch
from torch import nn

from barqtrain import ops
from barqtrain.lora import lora_gated_mlp
from barqtrain.memory.tiling import tiled_module_call
from barqtrain.patch.fallback import fall_back
from barqtrain.patch.lora import block_projections
from barqtrain.patch.replacement import ModuleReplacement, qualified_name

OP = "glu"


def looks_like_mlp(module: nn.Module) -> bool:
    return type(module).__name__.endswith("MLP")


# Activation classes (by qualified name, so that transformers need not be imported) -> the
# ops.glu activation that computes them, with the config's hidden_act that makes each.
# Exact classes only: a subclass, or another GELU (erf, "gelu_new", ...), computes otherwise.
_GLU_ACTIVATIONS = {
    "transformers.activations.SiLUActivation": "silu",  # "silu"
    "torch.nn.modules.activation.SiLU": "silu",  # "swish"
    "transformers.activations.GELUTanh": "gelu_tanh",  # "gelu_pytorch_tanh", "gelu_python_tanh"
}


def _glu_activation(activation_fn: nn.Module) -> str | None:
    """The ops.glu activation that computes `activation_fn`, or None when none does."""
    if type(activation_fn) is nn.GELU:
        return "gelu_tanh" if activation_fn.approximate == "tanh" else None
    return _GLU_ACTIVATIONS.get(qualified_name(type(activation_fn)))


def _unsupported_activation(activation_fn: nn.Module) -> str | None:
    if _glu_activation(activation_fn) is not None:
        return None
    return f"activation {type(activation_fn).__name__} is neither SiLU nor tanh-approximated GELU"


def gate_up_mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """LlamaMLP and its copies (Mistral, Qwen2, Qwen3, Gemma 1/2/3): separate gate_proj and up_proj."""
    return tiled_module_call(self, _gate_up_mlp, x)


def _gate_up_mlp(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    activation = _glu_activation(self.act_fn)
    if activation is None:
        return fall_back(self, _unsupported_activation(self.act_fn))(x)
    projections = block_projections([self.gate_proj, self.up_proj, self.down_proj], x)
    if projections is not None:
        *gate_up, down = projections
        return lora_gated_mlp(x, gate_up, down, activation)
    return self.down_proj(ops.glu(self.gate_proj(x), self.up_proj(x), activation))


def fused_gate_up_mlp_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """Phi3MLP: one gate_up_proj whose output halves are gate and up (strided views, no copy)."""
    return tiled_module_call(self, _fused_gate_up_mlp, hidden_states)


def _fused_gate_up_mlp(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    activation = _glu_activation(self.activation_fn)
    if activation is None:
        return fall_back(self, _unsupported_activation(self.activation_fn))(hidden_states)
    projections = block_projections([self.gate_up_proj, self.down_proj], hidden_states)
    if projections is not None:
        gate_up, down = projections
        return lora_gated_mlp(hidden_states, [gate_up], down, activation)
    gate, up = self.gate_up_proj(hidden_states).chunk(2, dim=-1)
    return self.down_proj(ops.glu(gate, up, activation))


def is_patched_mlp(module: nn.Module) -> bool:
    """Whether `module` computes one of the forwards above (patched per instance or per class)."""
    forward = getattr(module, "forward", None)
    return getattr(forward, "__func__", None) in (gate_up_mlp_forward, fused_gate_up_mlp_forward)


def gate_up_mlp(module_class: str) -> ModuleReplacement:
    return ModuleReplacement(OP, module_class, gate_up_mlp_forward, lambda mlp: _unsupported_activation(mlp.act_fn))


def fused_gate_up_mlp(module_class: str) -> ModuleReplacement:
    return ModuleReplacement(
        OP, module_class, fused_gate_up_mlp_forward, lambda mlp: _unsupported_activation(mlp.activation_fn)
    )
