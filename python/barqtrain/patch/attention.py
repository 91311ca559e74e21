"""Attention-module replacements. Each family's attention class has two, one per op:

- rope (a default op): Hugging Face's attention forward with RoPE computed by
  barqtrain.ops.apply_rope instead of apply_rotary_pos_emb. Everything else is what Hugging
  Face does: the projections (called, so PEFT LoRA keeps working; q, k and v are one
  barqtrain.lora.lora_projections where they are LoRA layers patched by BarqTrain and plain
  nn.Linear), Qwen3's and Gemma 3's q/k norms, the KV-cache update, and the attention itself
  through the function Hugging Face selects from config._attn_implementation, with each
  family's sliding window, softcap and scaling.
- attention (opt-in, see FUSED_OP_OPT_IN): the same projections, then barqtrain.ops.attention
  with RoPE fused into the op (Hugging Face's own cos/sin of this call as the tables),
  the family's window, softcap and scaling, GQA, and no token attending across a sequence
  boundary of a packed batch (see sequence_layout). Calls it does not cover go the rope way,
  with one warning per reason.

The families' forwards differ only in the few ways an AttentionVariant names; one function
computes them all.
"""

from __future__ import annotations

import sys
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from barqtrain import ops
from barqtrain.lora import lora_projections
from barqtrain.memory.tiling import Tile, tiled
from barqtrain.ops.attention import MAX_HEAD_DIM_BACKWARD, kernel_unsupported_reason, rotate_rows, warn_fallback
from barqtrain.patch import causal_mask
from barqtrain.patch.lora import block_projections
from barqtrain.patch.replacement import ModuleReplacement, simple_name

if TYPE_CHECKING:
    from transformers.modeling_utils import AttentionInterface

OP = "rope"
FUSED_OP = "attention"

# Why FUSED_OP is not a default op, as the patch report says it (docs/design/attention.md has the
# measurements; `barqtrain bench attn` and `barqtrain bench e2e` measure it again).
FUSED_OP_OPT_IN = (
    "opt-in (ops=(*barqtrain.patch.OPS, 'attention')): a LoRA step with BarqTrain's attention kernels is "
    "still 2-3% slower than with the default path on an H100 (Llama-3.1-8B shape: 7,336 vs 7,487 tokens/s), "
    "and its sm_80 kernels are slower than SDPA's flash backend; ask for it for packed batches without "
    "cross-sequence attention, a logit softcap at head_dim <= 128, or a bit-identical backward"
)

# What the fallback of FUSED_OP runs, as its warnings name it.
_HUGGING_FACE_ATTENTION = "Hugging Face's attention (with BarqTrain's RoPE)"

# (module, query, key, value, attention_mask, **kwargs) -> (attn_output, attn_weights)
AttentionFunction = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def looks_like_attention(module: nn.Module) -> bool:
    return type(module).__name__.endswith("Attention")


def config_sliding_window(attention: nn.Module) -> int | None:
    """Mistral, Phi-3: config.sliding_window for every layer."""
    return getattr(attention.config, "sliding_window", None)


def layer_sliding_window(attention: nn.Module) -> int | None:
    """Qwen2, Qwen3, Gemma 2, Gemma 3: the layer's own window (None on full-attention layers)."""
    return attention.sliding_window


@dataclass(frozen=True)
class AttentionVariant:
    """How one family's attention forward differs from Llama's."""

    # Phi-3: one qkv_proj whose output is split into q, k and v.
    fused_qkv: bool = False
    # Qwen3, Gemma 3: RMSNorms of each head's q and k, before RoPE.
    qk_norm: bool = False
    # Passed as the attention function's sliding_window; Llama and Gemma pass none.
    sliding_window: Callable[[nn.Module], int | None] | None = None
    # Gemma 2: attn_logit_softcapping passed as softcap (Gemma 3's config has one, unused).
    softcap: bool = False

    def window(self, attention: nn.Module) -> int | None:
        """The sliding window of this module's attention, or None for full attention."""
        return self.sliding_window(attention) if self.sliding_window is not None else None


def _hf_attention_dispatch(modeling_module: str) -> tuple[AttentionInterface, AttentionFunction]:
    """The ALL_ATTENTION_FUNCTIONS and eager_attention_forward that `modeling_module`'s forwards
    dispatch with (Gemma 2's and Gemma 3's eager function takes a softcap, Llama's does not).
    The module is imported: a patched instance of its attention class exists. sys.modules,
    unlike importlib, is read by torch.compile without a graph break."""
    module = sys.modules[modeling_module]
    return module.ALL_ATTENTION_FUNCTIONS, module.eager_attention_forward


def _project(modules: list[nn.Module], hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each module's projection of hidden_states: one barqtrain.lora.lora_projections where they
    are LoRA layers patched by BarqTrain and plain nn.Linear, else the modules' own calls."""
    projections = block_projections(modules, hidden_states)
    if projections is None:
        return tuple(module(hidden_states) for module in modules)
    return lora_projections(hidden_states, projections)


def _project_qkv(
    attention: nn.Module, hidden_states: torch.Tensor, variant: AttentionVariant
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query, key and value as [batch, seq, heads, head_dim] (views of the projections)."""
    hidden_shape = (*hidden_states.shape[:-1], -1, attention.head_dim)
    if variant.fused_qkv:
        qkv = attention.qkv_proj(hidden_states)
        query_size = attention.config.num_attention_heads * attention.head_dim
        key_size = attention.num_key_value_heads * attention.head_dim
        query, key, value = qkv.split([query_size, key_size, qkv.shape[-1] - query_size - key_size], dim=-1)
    else:
        query, key, value = _project([attention.q_proj, attention.k_proj, attention.v_proj], hidden_states)
    query, key, value = query.view(hidden_shape), key.view(hidden_shape), value.view(hidden_shape)
    if variant.qk_norm:
        # Over head_dim, so before the transpose (Qwen3) or after it (Gemma 3) computes the
        # same; before, the rows are contiguous.
        query, key = attention.q_norm(query), attention.k_norm(key)
    return query, key, value


def _rotate(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    # Hugging Face's q * cos promotes: under autocast, bfloat16 q and k with the float32
    # tables of a float32 model give float32 results, so the op computes in that dtype too.
    dtype = torch.promote_types(query.dtype, cos.dtype)
    return ops.apply_rope(query.to(dtype), key.to(dtype), cos, sin)


def attend(
    attention: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    variant: AttentionVariant,
    modeling_module: str,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention itself, as the forward of `modeling_module`'s attention class computes
    it: the one call a BarqTrain attention kernel will take over."""
    all_attention_functions, eager_attention_forward = _hf_attention_dispatch(modeling_module)
    attention_interface = all_attention_functions.get_interface(
        attention.config._attn_implementation, eager_attention_forward
    )
    family_kwargs = {}
    if variant.sliding_window is not None:
        family_kwargs["sliding_window"] = variant.sliding_window(attention)
    if variant.softcap:
        family_kwargs["softcap"] = attention.attn_logit_softcapping
    return attention_interface(
        attention,
        query,
        key,
        value,
        attention_mask,
        dropout=attention.attention_dropout if attention.training else 0.0,
        scaling=attention.scaling,
        **family_kwargs,
        **kwargs,
    )


def _hugging_face_attention(
    attention: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None,
    past_key_values: Any,
    variant: AttentionVariant,
    modeling_module: str,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rest of Hugging Face's forward after the projections ([batch, seq, heads, head_dim]),
    with BarqTrain's RoPE: the rope op's forward, and FUSED_OP's fallback."""
    cos, sin = position_embeddings
    query, key = _rotate(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
    value = value.transpose(1, 2)
    if past_key_values is not None:
        key, value = past_key_values.update(key, value, attention.layer_idx)
    attn_output, attn_weights = attend(attention, query, key, value, attention_mask, variant, modeling_module, **kwargs)
    attn_output = attn_output.reshape(*attn_output.shape[:2], -1).contiguous()
    return attention.o_proj(attn_output), attn_weights


def attention_with_rope(module_class: str, variant: AttentionVariant) -> ModuleReplacement:
    """The rope op's replacement of one family's attention class."""
    # Where the class is defined, with the attention functions its forward dispatches to.
    modeling_module = module_class.rsplit(".", 1)[0]

    def forward(
        self: nn.Module,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        query, key, value = _project_qkv(self, hidden_states, variant)
        return _hugging_face_attention(
            self, query, key, value, position_embeddings, attention_mask, past_key_values, variant, modeling_module,
            kwargs,
        )

    forward.__qualname__ = f"attention_with_rope({simple_name(module_class)}).forward"
    return ModuleReplacement(OP, module_class, forward)


# ------------------------------------------------------------------ the fused attention op


@dataclass(frozen=True)
class SequenceLayout:
    """Which tokens of a [batch, seq] call attend to which, for barqtrain.ops.attention."""

    # Flat indices (into batch * seq) of the tokens that are not padding; None: every token.
    kept: torch.Tensor | None
    # int32 [sequences + 1] prefix sums over the kept tokens; None: each row is one sequence.
    cu_seqlens: torch.Tensor | None
    max_seqlen: int


# Masks are compared a block of query rows at a time, so that the comparison needs no more
# than this many elements per temporary however long the sequence.
_MASK_CHECK_ELEMENTS = 1 << 24


def _causal_visible(queries: torch.Tensor, keys: torch.Tensor, window: int | None) -> torch.Tensor:
    """[queries, keys] booleans: True where the query at each position in `queries` sees the key
    at each position in `keys` under causal attention and the sliding window."""
    visible = keys[None, :] <= queries[:, None]
    if window is not None:
        visible &= keys[None, :] > queries[:, None] - window
    return visible


def _mask_matches(
    visible: torch.Tensor, valid: torch.Tensor, sequence_ids: torch.Tensor, window: int | None
) -> bool:
    """Whether the prepared 4D mask `visible` ([batch, seq, seq], True where query i sees key j)
    is what Hugging Face makes of causal attention, the family's window and the padding, with or
    without the packed sequences: then the layout computes the same (plus packing, the point of
    it, where Hugging Face's mask leaves it out, as it does when a KV cache is passed). Rows of
    padding queries are not compared: their outputs are zero, as in Transformers' flash path."""
    seq = visible.shape[-1]
    keys = torch.arange(seq, device=visible.device)
    rows_per_block = max(1, _MASK_CHECK_ELEMENTS // (visible.shape[0] * seq))
    for start in range(0, seq, rows_per_block):
        implied = _causal_visible(keys[start : start + rows_per_block], keys, window) & valid[:, None, :]
        same_sequence = sequence_ids[:, start : start + rows_per_block, None] == sequence_ids[:, None, :]
        given = visible[:, start : start + rows_per_block]
        compared = valid[:, start : start + rows_per_block, None]
        matches_plain = ((given == implied) | ~compared).all()
        matches_packed = ((given == (implied & same_sequence)) | ~compared).all()
        if not (matches_plain | matches_packed).item():
            return False
    return True


def _sequence_starts(
    position_ids: torch.Tensor | None, cu_seq_lens: torch.Tensor | None, batch: int, seq: int, device: torch.device
) -> torch.Tensor | str:
    """[batch, seq] booleans, true at each token that starts a sequence (see sequence_layout), or
    why cu_seq_lens do not describe the batch."""
    starts = torch.zeros(batch, seq, dtype=torch.bool, device=device)
    starts[:, 0] = True
    if cu_seq_lens is not None:
        if cu_seq_lens.dim() != 1 or cu_seq_lens[-1].item() != batch * seq:
            return f"cu_seq_lens {list(cu_seq_lens.shape)} not ending at the {batch * seq} tokens of the batch"
        starts.view(-1)[cu_seq_lens[:-1].to(device, torch.long)] = True
    elif position_ids is not None:
        positions = position_ids.to(device).expand(batch, seq)
        starts[:, 1:] |= positions[:, 1:] - positions[:, :-1] != 1
    return starts


def packed_causal_mask(
    position_ids: torch.Tensor | None,
    cu_seq_lens: torch.Tensor | None,
    batch: int,
    seq: int,
    window: int | None,
    device: torch.device,
) -> torch.Tensor | None:
    """The [batch, 1, seq, seq] boolean mask (true: attended) of causal attention within each
    packed sequence and sliding window, as Hugging Face builds it for packed rows; None where
    plain causal attention is all there is (one sequence a row, no window shorter than it).
    What the attention op's fallback passes Hugging Face's attention where no mask was built
    (barqtrain.patch.causal_mask.set_layers_read_positions)."""
    starts = _sequence_starts(position_ids, cu_seq_lens, batch, seq, device)
    if isinstance(starts, str):
        raise ValueError(f"barqtrain: {starts}")
    packed = bool(starts[:, 1:].any())
    if not packed and (window is None or window >= seq):
        return None
    sequence_ids = starts.cumsum(1)
    positions = torch.arange(seq, device=device)
    visible = _causal_visible(positions, positions, window) & (sequence_ids[:, :, None] == sequence_ids[:, None, :])
    return visible[:, None]


def sequence_layout(
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    cu_seq_lens: torch.Tensor | None,
    batch: int,
    seq: int,
    window: int | None,
    device: torch.device,
) -> SequenceLayout | str:
    """The layout of one call (tensors on `device`), or why the fused op cannot compute it.

    Padding comes from the attention mask as the layer receives it: None (no padding), the 2D
    [batch, seq] mask of the flash implementations, or the prepared 4D mask of eager/SDPA
    (a token is padding when it cannot see itself), which must then be causal + window +
    padding (+ packing): anything else, e.g. a custom 4D mask, is refused rather than
    reinterpreted. Sequences start at each row's start and, as in Transformers' packed-sequence
    detection, wherever position_ids do not step by 1 (DataCollatorWithFlattening, PackedLoader),
    or at the cu_seq_lens Transformers passes with return_flash_attn_kwargs=True.
    """
    valid = None
    visible = None
    if attention_mask is not None:
        if attention_mask.dim() == 2:
            if tuple(attention_mask.shape) != (batch, seq):
                return f"a 2D attention mask of shape {list(attention_mask.shape)} for {batch} rows of {seq} tokens"
            valid = attention_mask.bool()
        elif attention_mask.dim() == 4:
            if attention_mask.shape[1] != 1 or attention_mask.shape[0] not in (1, batch) or tuple(
                attention_mask.shape[2:]
            ) != (seq, seq):
                return (
                    f"a 4D attention mask of shape {list(attention_mask.shape)} (the fused op takes "
                    f"[{batch}, 1, {seq}, {seq}]: no cached tokens)"
                )
            as_bool = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
            visible = as_bool[:, 0].expand(batch, seq, seq)
            valid = visible.diagonal(dim1=1, dim2=2)
        else:
            return f"an attention mask of {attention_mask.dim()} dimensions"

    starts = _sequence_starts(position_ids, cu_seq_lens, batch, seq, device)
    if isinstance(starts, str):
        return starts
    sequence_ids = starts.view(-1).cumsum(0).view(batch, seq)

    if visible is not None and not _mask_matches(visible, valid, sequence_ids, window):
        return "an attention mask that is not causal attention with padding (e.g. a custom 4D mask)"

    flat_starts = starts.view(-1)
    kept = None
    if valid is not None and not bool(valid.all()):
        kept = valid.reshape(-1).nonzero().view(-1)
        if kept.numel() == 0:
            return "a batch made of padding only"
        # Among the kept tokens, a sequence starts where the sequence id changes (its first
        # tokens may have been padding).
        kept_ids = sequence_ids.view(-1)[kept]
        flat_starts = torch.ones_like(kept, dtype=torch.bool)
        flat_starts[1:] = kept_ids[1:] != kept_ids[:-1]
    sequence_starts = flat_starts.nonzero().view(-1)
    if kept is None and sequence_starts.numel() == batch:
        return SequenceLayout(None, None, seq)
    total = torch.tensor([flat_starts.numel()], device=sequence_starts.device)
    cu_seqlens = torch.cat((sequence_starts, total)).to(torch.int32)
    return SequenceLayout(kept, cu_seqlens, int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item()))


class _LayoutCache:
    """The layouts of the last few distinct (mask, position_ids, cu_seq_lens) tensors: every
    layer of one model call passes the same ones (one mask per layer type), so a model call
    computes its layout (a device sync, and a pass over a 4D mask) once, not once per layer,
    and the recomputation of gradient checkpointing finds it again."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._entries: OrderedDict[tuple, tuple[tuple, SequenceLayout | str]] = OrderedDict()

    @staticmethod
    def _identity(t: torch.Tensor | None) -> tuple | None:
        # The version counter: a buffer refilled in place (a data loader's) is a new input.
        return None if t is None else (weakref.ref(t), t._version)

    def layout(
        self,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        cu_seq_lens: torch.Tensor | None,
        batch: int,
        seq: int,
        window: int | None,
        device: torch.device,
    ) -> SequenceLayout | str:
        tensors = (attention_mask, position_ids, cu_seq_lens)
        key = (*(id(t) for t in tensors), batch, seq, window, device)
        identities = tuple(self._identity(t) for t in tensors)
        cached = self._entries.get(key)
        if cached is not None:
            held, layout = cached
            if all(
                (h is None and t is None) or (h is not None and t is not None and h[0]() is t and h[1] == t._version)
                for h, t in zip(held, tensors, strict=True)
            ):
                self._entries.move_to_end(key)
                return layout
        layout = sequence_layout(attention_mask, position_ids, cu_seq_lens, batch, seq, window, device)
        self._entries[key] = (identities, layout)
        if len(self._entries) > self._size:
            self._entries.popitem(last=False)
        return layout


_layouts = _LayoutCache(size=8)


def _unsupported_call(
    attention: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    rotary_dim: int | None,
    needs_grad: bool,
    attention_mask: Any,
    past_key_values: Any,
    kwargs: dict[str, Any],
) -> str | None:
    """Why barqtrain.ops.attention cannot compute this call, or None. rotary_dim: of the RoPE the
    op applies (None: q and k come rotated); needs_grad: whether a backward follows."""
    if kwargs.get("output_attentions"):
        return "output_attentions=True (the kernels never form the attention weights)"
    if kwargs.get("is_causal") is False:
        return "is_causal=False (bidirectional attention)"
    dropout = attention.attention_dropout if attention.training else 0.0
    if dropout > 0:
        return f"attention dropout {dropout} in training"
    if past_key_values is not None and past_key_values.get_seq_length(attention.layer_idx) > 0:
        return "a KV cache holding earlier tokens (generation)"
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        return f"an attention mask of type {type(attention_mask).__name__} (e.g. flex_attention's BlockMask)"
    if query.device.type not in ("cpu", "cuda"):
        return f"device {query.device.type}"
    if not (query.dtype == key.dtype == value.dtype):
        return f"q, k and v of different dtypes ({query.dtype}, {key.dtype}, {value.dtype})"
    return kernel_unsupported_reason(query, rotary_dim, needs_grad)


def _attention_options(
    attention: nn.Module,
    batch: int,
    seq: int,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    variant: AttentionVariant,
) -> dict[str, Any]:
    """barqtrain.ops.attention's arguments for this module's call, but the tensors and layout."""
    cos, sin = position_embeddings
    # Hugging Face's tables repeat their first half (rotate_half); the op takes one half per
    # token, indexed by the token's flat position in the batch.
    half = cos.shape[-1] // 2
    window = variant.window(attention)
    return {
        "causal": True,
        "softmax_scale": attention.scaling,
        "softcap": (attention.attn_logit_softcapping or 0.0) if variant.softcap else 0.0,
        "window_left": window - 1 if window is not None else -1,
        "rope_cos": cos[..., :half].expand(batch, seq, half).reshape(batch * seq, half),
        "rope_sin": sin[..., :half].expand(batch, seq, half).reshape(batch * seq, half),
    }


def _fused_attention(
    attention: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    layout: SequenceLayout,
    variant: AttentionVariant,
) -> torch.Tensor:
    """Attention of [batch, seq, heads, head_dim] projections through barqtrain.ops.attention;
    returns [batch, seq, q_heads * head_dim]."""
    batch, seq, heads, head_dim = query.shape
    options = _attention_options(attention, batch, seq, position_embeddings, variant)
    if layout.cu_seqlens is None:
        positions = torch.arange(batch * seq, device=query.device).view(batch, seq)
        output = ops.attention(query, key, value, position_ids=positions, **options)
        return output.reshape(batch, seq, -1)

    def rows(t: torch.Tensor) -> torch.Tensor:
        t = t.reshape(batch * seq, *t.shape[2:])
        return t if layout.kept is None else t[layout.kept]

    positions = layout.kept if layout.kept is not None else torch.arange(batch * seq, device=query.device)
    output = ops.attention(
        rows(query), rows(key), rows(value), cu_seqlens_q=layout.cu_seqlens, cu_seqlens_k=layout.cu_seqlens,
        max_seqlen_q=layout.max_seqlen, max_seqlen_k=layout.max_seqlen, position_ids=positions, **options,
    )
    if layout.kept is not None:
        # Padding tokens' outputs are zero, as in Transformers' flash-attention path.
        output = output.new_zeros(batch * seq, heads, head_dim).index_copy(0, layout.kept, output)
    return output.reshape(batch, seq, -1)


# ------------------------------------------------------------------ shifted sparse attention

# The attribute of a FUSED_OP-patched attention module that holds its S²-Attn group size in
# tokens (absent or 0: full attention).
S2_ATTRIBUTE = "barqtrain_s2_group_size"
# Every family's FUSED_OP forward, as fused_attention makes them.
_FUSED_FORWARDS: set[Callable[..., Any]] = set()


def set_shifted_sparse_attention(model: nn.Module, group_size: int) -> int:
    """LongLoRA's shifted sparse attention (S²-Attn) in the training forwards of every attention
    module of `model` patched with the attention op (ops=(*OPS, "attention")); 0 turns it off.
    Returns how many modules it applies to.

    In training, each row's tokens are cut into groups of `group_size` and attend only within
    their group (causally, and within their packed sequence): half of the heads on groups
    starting at 0, group_size, 2 group_size, ..., the other half on groups shifted by half a
    group (starting at 0, group_size / 2, 3 group_size / 2, ...), so that information crosses
    every boundary of the first half's groups. LongLoRA rolls the shifted heads' tokens and so
    lets a row's first tokens attend to its last; here the shifted groups are varlen segments,
    and no token sees a later one. Attention costs O(seq · group_size) instead of O(seq²).
    In evaluation (module.eval()) the attention is full, as LongLoRA evaluates."""
    if group_size < 0 or group_size % 2:
        raise ValueError(f"barqtrain: the S²-Attn group size must be an even number of tokens (0: off), got {group_size}")
    modules = [m for m in model.modules() if _is_fused_attention_forward(vars(m).get("forward"))]
    if group_size and not modules:
        raise ValueError(
            "barqtrain: shifted sparse attention runs on the attention op, and no attention module of this model is "
            "patched with it: patch_model(model, ops=(*barqtrain.patch.OPS, 'attention'))"
        )
    for module in modules:
        heads, kv_heads = module.config.num_attention_heads, getattr(module.config, "num_key_value_heads", None)
        kv_heads = kv_heads or heads
        if group_size and (heads % 2 or kv_heads % 2):
            raise ValueError(
                f"barqtrain: shifted sparse attention shifts half of the heads, so it needs an even number of query "
                f"and key/value heads; this model has {heads} and {kv_heads}"
            )
        setattr(module, S2_ATTRIBUTE, group_size)
    return len(modules)


def _is_fused_attention_forward(forward: object) -> bool:
    return getattr(forward, "__func__", None) in _FUSED_FORWARDS


_s2_boundaries: dict[tuple, tuple[torch.Tensor, int]] = {}


def _s2_segments(
    layout: SequenceLayout, batch: int, seq: int, group: int, shifted: bool, device: torch.device
) -> tuple[torch.Tensor, int]:
    """cu_seqlens of one half of the heads' groups, cut further at the packed sequences' starts,
    and the longest segment (at most `group`)."""
    key = (batch, seq, group, shifted, device)
    if layout.cu_seqlens is None and key in _s2_boundaries:
        return _s2_boundaries[key]
    row_starts = torch.arange(batch, dtype=torch.int64)[:, None] * seq
    in_row = torch.arange(group // 2 if shifted else 0, seq, group, dtype=torch.int64)
    starts = [torch.arange(0, batch * seq, seq, dtype=torch.int64), (row_starts + in_row).reshape(-1)]
    if layout.cu_seqlens is not None:
        starts.append(layout.cu_seqlens[:-1].to("cpu", torch.int64))  # a sync, as the packed layout's own
    bounds = torch.cat((torch.unique(torch.cat(starts)), torch.tensor([batch * seq])))
    segments = (bounds.to(torch.int32).to(device), int((bounds[1:] - bounds[:-1]).max()))
    if layout.cu_seqlens is None:
        _s2_boundaries[key] = segments
    return segments


def _shifted_sparse_attention(
    attention: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    layout: SequenceLayout,
    variant: AttentionVariant,
    group: int,
) -> torch.Tensor:
    """S²-Attn (set_shifted_sparse_attention) of [batch, seq, heads, head_dim] projections;
    returns [batch, seq, q_heads * head_dim]."""
    if layout.kept is not None:
        raise ValueError(
            "barqtrain: shifted sparse attention takes batches without padding; pack the rows (data.packing) or "
            "give every row the full length"
        )
    batch, seq, heads, head_dim = query.shape
    kv_heads = key.shape[2]
    options = _attention_options(attention, batch, seq, position_embeddings, variant)
    positions = torch.arange(batch * seq, device=query.device)
    halves = []
    for shifted, q_heads, kv in ((False, slice(0, heads // 2), slice(0, kv_heads // 2)),
                                 (True, slice(heads // 2, heads), slice(kv_heads // 2, kv_heads))):  # fmt: skip
        cu_seqlens, longest = _s2_segments(layout, batch, seq, group, shifted, query.device)
        halves.append(ops.attention(
            query[:, :, q_heads].reshape(batch * seq, -1, head_dim), key[:, :, kv].reshape(batch * seq, -1, head_dim),
            value[:, :, kv].reshape(batch * seq, -1, head_dim), cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
            max_seqlen_q=longest, max_seqlen_k=longest, position_ids=positions, **options,
        ))  # fmt: skip
    return torch.cat(halves, dim=1).reshape(batch, seq, -1)


def fused_attention(module_class: str, variant: AttentionVariant) -> ModuleReplacement:
    """FUSED_OP's replacement of one family's attention class."""
    modeling_module = module_class.rsplit(".", 1)[0]

    def forward(
        self: nn.Module,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        tile_tokens = getattr(self, TILE_ATTRIBUTE, 0) if self.training and torch.is_grad_enabled() else 0
        if tile_tokens and hidden_states.shape[0] * hidden_states.shape[1] > tile_tokens:
            output = _query_tiled_attention(
                self, hidden_states, position_embeddings, attention_mask, past_key_values, variant, tile_tokens, kwargs
            )
            return output, None
        query, key, value = _project_qkv(self, hidden_states, variant)
        cos, _ = position_embeddings
        s2_group = getattr(self, S2_ATTRIBUTE, 0) if self.training else 0
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        reason = _unsupported_call(
            self, query, key, value, cos.shape[-1], needs_grad, attention_mask, past_key_values, kwargs
        )
        window = variant.window(self)
        if reason is None:
            layout = _layouts.layout(
                attention_mask, kwargs.get("position_ids"), kwargs.get("cu_seq_lens_q"), *query.shape[:2], window,
                query.device,
            )
            reason = layout if isinstance(layout, str) else None
        if reason is not None and s2_group:
            raise ValueError(f"barqtrain: shifted sparse attention needs the attention op, which cannot compute {reason}")
        if reason is not None:
            warn_fallback(reason, _HUGGING_FACE_ATTENTION)
            without_cached_tokens = past_key_values is None or past_key_values.get_seq_length(self.layer_idx) == 0
            if attention_mask is None and without_cached_tokens and causal_mask.layers_read_positions(self.config):
                attention_mask = packed_causal_mask(
                    kwargs.get("position_ids"), kwargs.get("cu_seq_lens_q"), *query.shape[:2], window, query.device
                )
            return _hugging_face_attention(
                self, query, key, value, position_embeddings, attention_mask, past_key_values, variant,
                modeling_module, kwargs,
            )
        if past_key_values is not None:
            # An empty cache (a forward with use_cache=True) is filled as Hugging Face fills it:
            # with the rotated keys, which the fused op never writes out.
            _, rotated_key = _rotate(query.transpose(1, 2), key.transpose(1, 2), *position_embeddings)
            past_key_values.update(rotated_key, value.transpose(1, 2), self.layer_idx)
        if s2_group:
            attn_output = _shifted_sparse_attention(
                self, query, key, value, position_embeddings, layout, variant, s2_group
            )
        else:
            attn_output = _fused_attention(self, query, key, value, position_embeddings, layout, variant)
        return self.o_proj(attn_output), None

    forward.__qualname__ = f"fused_attention({simple_name(module_class)}).forward"
    _FUSED_FORWARDS.add(forward)
    return ModuleReplacement(FUSED_OP, module_class, forward, _untrainable_head_dim)


# ------------------------------------------------------------------ attention tiled by queries

# The attribute of a FUSED_OP-patched attention module that holds its query tile size in tokens
# (absent or 0: untiled), set by barqtrain.memory.set_attention_tile_tokens.
TILE_ATTRIBUTE = "barqtrain_attention_tile_tokens"


def is_fused_attention(module: nn.Module) -> bool:
    """Whether `module`'s forward is the attention op's replacement (patch_model with 'attention')."""
    return _is_fused_attention_forward(vars(module).get("forward"))


@dataclass(frozen=True)
class _QueryTile:
    """barqtrain.ops.attention's varlen arguments for one tile's queries and their keys."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


def query_tiles(starts: list[int], total: int, tile_tokens: int) -> list[tuple[Tile, list[int], list[int]]]:
    """Tiles of `tile_tokens` query rows over `total` flat rows whose sequences start at `starts`
    (ascending, the first 0), each with the key rows its queries see causally (from the start of
    the tile's first sequence to the tile's end: one contiguous range) and the cu_seqlens of
    its queries and keys, per sequence it meets. A sequence cut by a tile's start keeps all its
    earlier keys: queries are the last rows of their keys, which is the attention op's causal
    alignment for sequences with more keys than queries."""
    bounds = [*starts, total]
    tiles = []
    first = 0
    for start in range(0, total, tile_tokens):
        end = min(start + tile_tokens, total)
        while bounds[first + 1] <= start:
            first += 1
        keys_from = bounds[first]
        cu_q, cu_k = [0], [0]
        sequence = first
        while sequence < len(starts) and bounds[sequence] < end:
            cut = min(bounds[sequence + 1], end)
            cu_q.append(cut - start)
            cu_k.append(cut - keys_from)
            sequence += 1
        tiles.append((Tile(slice(start, end), slice(keys_from, end)), cu_q, cu_k))
    return tiles


def _query_tiled_attention(
    attention: nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None,
    past_key_values: Any,
    variant: AttentionVariant,
    tile_tokens: int,
    kwargs: dict[str, Any],
) -> torch.Tensor:
    """The attention block's output (o_proj's) for hidden_states [batch, seq, hidden], a tile of
    `tile_tokens` queries at a time (see barqtrain.memory.tiling): keys and values are projected
    and rotated for every token and kept; each tile projects, normalizes and rotates its queries,
    attends on the attention op to the keys its sequences hold up to the tile's end, and projects
    the result; the backward recomputes each tile. [tokens x q_heads x head_dim] tensors (q, its
    rotation, the attention output, their gradients) exist for one tile at a time."""
    if variant.fused_qkv:  # keys and values are projected on their own
        raise ValueError(
            f"barqtrain: attention tiled by queries (memory.attention_tile_tokens) cannot compute "
            f"{type(attention).__name__}'s one projection of q, k and v (qkv_proj); set memory.attention_tile_tokens: 0"
        )
    batch, seq, _ = hidden_states.shape
    head_dim = attention.head_dim
    key, value = _project([attention.k_proj, attention.v_proj], hidden_states)
    key, value = key.view(batch * seq, -1, head_dim), value.view(batch * seq, -1, head_dim)
    if variant.qk_norm:
        key = attention.k_norm(key)
    # Each tile rotates its own queries (no RoPE in the op), and a backward follows.
    reason = _unsupported_call(attention, key, key, value, None, True, attention_mask, past_key_values, kwargs)
    if reason is None and getattr(attention, S2_ATTRIBUTE, 0):
        reason = "shifted sparse attention (model.shifted_sparse_attention), whose groups already bound the attention"
    window = variant.window(attention)
    if reason is None:
        layout = _layouts.layout(
            attention_mask, kwargs.get("position_ids"), kwargs.get("cu_seq_lens_q"), batch, seq, window, key.device
        )
        reason = layout if isinstance(layout, str) else None
        if reason is None and layout.kept is not None:
            reason = "padding (attention tiling takes packed rows, data.packing)"
    if reason is not None:
        raise ValueError(
            f"barqtrain: attention tiled by queries (memory.attention_tile_tokens) cannot compute {reason}; "
            "set memory.attention_tile_tokens: 0"
        )
    starts = layout.cu_seqlens[:-1].tolist() if layout.cu_seqlens is not None else list(range(0, batch * seq, seq))
    options = _attention_options(attention, batch, seq, position_embeddings, variant)
    cos, sin = options.pop("rope_cos"), options.pop("rope_sin")
    key = rotate_rows(key, cos, sin)
    if past_key_values is not None:  # an empty cache (use_cache=True), filled as Hugging Face fills it
        past_key_values.update(*(t.view(batch, seq, -1, head_dim).transpose(1, 2) for t in (key, value)),
                               attention.layer_idx)  # fmt: skip
    plan = query_tiles(starts, batch * seq, tile_tokens)
    tiles = [tile for tile, _, _ in plan]
    bounds = [
        _QueryTile(torch.tensor(cu_q, dtype=torch.int32, device=key.device),
                   torch.tensor(cu_k, dtype=torch.int32, device=key.device),
                   max(b - a for a, b in zip(cu_q, cu_q[1:])), max(b - a for a, b in zip(cu_k, cu_k[1:])))
        for _, cu_q, cu_k in plan
    ]  # fmt: skip
    query_modules = [attention.q_proj, attention.o_proj] + ([attention.q_norm] if variant.qk_norm else [])

    def tile_output(index: int, rows: torch.Tensor, context: list[torch.Tensor]) -> torch.Tensor:
        tile, varlen = tiles[index], bounds[index]
        (query,) = _project([attention.q_proj], rows)
        query = query.view(rows.shape[0], -1, head_dim)
        if variant.qk_norm:
            query = attention.q_norm(query)
        query = rotate_rows(query, cos[tile.rows], sin[tile.rows])
        output = ops.attention(query, *context, cu_seqlens_q=varlen.cu_seqlens_q, cu_seqlens_k=varlen.cu_seqlens_k,
                               max_seqlen_q=varlen.max_seqlen_q, max_seqlen_k=varlen.max_seqlen_k, **options)  # fmt: skip
        return attention.o_proj(output.reshape(rows.shape[0], -1))

    parameters = [p for module in query_modules for p in module.parameters() if p.requires_grad]
    rows = hidden_states.reshape(batch * seq, -1)
    return tiled(tile_output, rows, tiles, [key, value], parameters).view(batch, seq, -1)


def _untrainable_head_dim(attention: nn.Module) -> str | None:
    """Why the attention op would not compute this module's training steps: a head_dim its
    backward kernels do not take (Gemma 2's 256), where every step would fall back."""
    head_dim = attention.head_dim
    if head_dim <= MAX_HEAD_DIM_BACKWARD:
        return None
    return (
        f"head_dim {head_dim}: the attention backward kernels take head_dim up to {MAX_HEAD_DIM_BACKWARD}, so "
        f"training would run {_HUGGING_FACE_ATTENTION} in every step"
    )
