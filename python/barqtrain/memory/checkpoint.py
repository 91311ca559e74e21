"""Gradient checkpointing whose kept layer inputs live in pinned CPU memory.

Checkpointing keeps one tensor per decoder layer, its input hidden states, and recomputes
the rest of the layer in the backward pass. At long sequences those inputs add up (a
Llama-3.1-8B at 2 x 4096 tokens keeps 64 MiB per layer, 2 GiB over 32 layers), so here they
leave the GPU: each is copied to a pinned host buffer on a separate copy stream while the
layer computes, and brought back on the same stream one layer ahead of the backward pass
that needs it, so that the compute stream waits for a copy only once per backward (for the
last layer's input, the first one needed).

    barqtrain.memory.enable_gradient_checkpointing(model)             # offload=True
    model.gradient_checkpointing_disable()                            # Hugging Face's, as usual

Stream safety: the copy stream waits on an event of the compute stream before it reads a
layer input (so the input is complete) or writes a device buffer the compute stream
allocated (so earlier work in that memory is done); the device input whose copy may still
be reading it is marked with `record_stream`, so the caching allocator does not hand its
memory out before the copy ends; the compute stream waits on the copy's event before the
recompute reads the restored input. Pinned buffers go back to a pool when their input is
restored and are reused by later layers and steps: the copies into and out of a buffer are
all on the one copy stream, hence in order.

On a CPU the inputs are kept as they are (there is nowhere to offload them to), which keeps
the arithmetic identical to the CUDA path and the tests meaningful.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint


def enable_gradient_checkpointing(model: nn.Module, offload: bool = True) -> None:
    """Hugging Face's gradient checkpointing on `model` (a PreTrainedModel or a PEFT model
    wrapping one), non-reentrant; with `offload`, every checkpointed layer's kept input is
    offloaded to pinned CPU memory by one OffloadedCheckpoint shared by the model's layers.

    Hugging Face's `gradient_checkpointing_enable` still sets the layers' flags; only the
    checkpoint function it installs is replaced. Its hook that makes the embedding output require
    grad (what LoRA on a frozen base needs with a reentrant checkpoint) stays with `offload` and is
    removed without (drop_input_require_grads). `gradient_checkpointing_disable()` undoes both."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not hasattr(base, "gradient_checkpointing_enable"):
        raise TypeError(
            f"{type(base).__name__} is not a Hugging Face PreTrainedModel (it has no gradient_checkpointing_enable)"
        )
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if offload:
        offloaded = OffloadedCheckpoint()
        for module in base.modules():
            # The modules Hugging Face's _set_gradient_checkpointing gave a checkpoint function.
            if hasattr(module, "gradient_checkpointing"):
                module._gradient_checkpointing_func = offloaded
    drop_input_require_grads(base)


# The name of the forward hook by which Hugging Face's enable_input_require_grads (called by
# gradient_checkpointing_enable and by PEFT's get_peft_model) makes the embedding output require grad.
_REQUIRE_GRADS_HOOK = "make_inputs_require_grads"


def drop_input_require_grads(model: nn.Module) -> int:
    """Removes the hooks that make the input embeddings' output require grad from `model` (a
    PreTrainedModel or a PEFT model wrapping one) when every checkpointed module runs torch's
    non-reentrant checkpoint; returns how many.

    Reentrant checkpointing needs its input to require grad to backpropagate into a frozen base's
    adapters; torch's non-reentrant one does not, so there the hook only costs: its
    `requires_grad_` on the embedding output is what keeps torch.compile from tracing a
    checkpointed model as one graph. OffloadedCheckpoint keeps them: it does not trace into one
    graph anyway, and with every layer input requiring grad its compiled layers share one graph."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    functions = [getattr(m, "_gradient_checkpointing_func", None) for m in base.modules()
                 if getattr(m, "gradient_checkpointing", False)]  # fmt: skip
    if not functions or not all(_non_reentrant(function) for function in functions):
        return 0
    get_embeddings = getattr(base, "get_input_embeddings", None)
    embeddings = get_embeddings() if callable(get_embeddings) else None
    if embeddings is None:
        return 0
    hooks = embeddings._forward_hooks
    found = [key for key, hook in hooks.items() if getattr(hook, "__name__", None) == _REQUIRE_GRADS_HOOK]
    for key in found:
        del hooks[key]
    return len(found)


def _non_reentrant(function: object) -> bool:
    return (
        isinstance(function, functools.partial)
        and function.func is torch_checkpoint
        and function.keywords.get("use_reentrant") is False
    )


def offloaded_checkpoint_of(model: nn.Module) -> OffloadedCheckpoint | None:
    """The OffloadedCheckpoint that enable_gradient_checkpointing installed in `model`, or
    None (for its pinned-memory statistics)."""
    for module in model.modules():
        function = getattr(module, "_gradient_checkpointing_func", None)
        if isinstance(function, OffloadedCheckpoint):
            return function
    return None


class _PinnedPool:
    """Pinned host buffers, reused: a request takes the smallest free buffer of its dtype that
    is large enough, and allocates only when none is. Buffers are pooled per device, as the
    copies of one device are ordered on its copy stream and those of two devices are not."""

    def __init__(self) -> None:
        self._free: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        self._lock = threading.RLock()  # re-entered when a freed graph's __del__ gives back a buffer
        self.allocated_bytes = 0
        self.allocations = 0

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        with self._lock:
            free = self._free.setdefault((device, dtype), [])
            fitting = [i for i, buffer in enumerate(free) if buffer.numel() >= numel]
            if fitting:
                return free.pop(min(fitting, key=lambda i: free[i].numel()))
            self.allocated_bytes += numel * dtype.itemsize
            self.allocations += 1
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def give_back(self, buffer: torch.Tensor, device: torch.device) -> None:
        with self._lock:
            self._free.setdefault((device, buffer.dtype), []).append(buffer)


class _KeptInput:
    """One checkpointed layer's input between its forward and its backward: on CUDA in a pinned
    host buffer (and, once fetched, in a device buffer again); on a CPU the tensor itself."""

    def __init__(self, owner: OffloadedCheckpoint, tensor: torch.Tensor) -> None:
        self._owner = owner
        self.shape, self.dtype, self.device = tensor.shape, tensor.dtype, tensor.device
        self._host: torch.Tensor | None = None  # the pinned buffer (flat, possibly longer than the input)
        self._restored: torch.Tensor | None = None  # on the device (CUDA) or the input itself (CPU)
        self._ready: torch.cuda.Event | None = None  # the host-to-device copy's end
        if tensor.device.type != "cuda":
            self._restored = tensor.detach()
            return
        stream = owner.copy_stream(tensor.device)
        self._host = owner.pool.take(tensor.numel(), tensor.dtype, tensor.device)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(stream):
            self._host[: tensor.numel()].view(tensor.shape).copy_(tensor, non_blocking=True)
        tensor.record_stream(stream)

    @property
    def fetched(self) -> bool:
        return self._restored is not None

    def fetch(self) -> None:
        """Starts the host-to-device copy on the copy stream (no wait on the host)."""
        if self.fetched:
            return
        compute = torch.cuda.current_stream(self.device)
        restored = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        stream = self._owner.copy_stream(self.device)
        stream.wait_stream(compute)  # the memory just allocated may still be in use by earlier compute work
        with torch.cuda.stream(stream):
            restored.copy_(self._host[: restored.numel()].view(self.shape), non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record(stream)
        self._restored = restored

    def take(self) -> torch.Tensor:
        """The input, back where it was computed, once the compute stream may read it; the
        pinned buffer returns to the pool (its next writer queues on the same copy stream)."""
        self.fetch()
        restored, self._restored = self._restored, None
        if self._ready is not None:
            torch.cuda.current_stream(self.device).wait_event(self._ready)
            self._ready = None
        if self._host is not None:
            self._owner.pool.give_back(self._host, self.device)
            self._host = None
        return restored

    def __del__(self) -> None:
        # A graph freed without a backward (an exception, a loss never backpropagated).
        try:
            if self._ready is not None and self._restored is not None:
                self._restored.record_stream(self._owner.copy_stream(self.device))
            if self._host is not None:
                self._owner.pool.give_back(self._host, self.device)
        except Exception:  # interpreter shutdown
            pass


class OffloadedCheckpoint:
    """A checkpoint function for Hugging Face's `_gradient_checkpointing_func`, called as
    `checkpoint(function, hidden_states, *args)` for each checkpointed layer.

    The forward runs `function` without building a graph and keeps only `hidden_states` (the
    first positional argument), offloaded to pinned host memory on CUDA. The backward restores
    it, recomputes `function` with the RNG and autocast states of the forward, and
    backpropagates through the recomputed outputs: gradients accumulate into the layer's
    parameters (LoRA's), and the input's gradient flows on to the layer before. One instance
    serves all layers of a model: it keeps the kept inputs in forward order, so that the
    backward of a layer starts the copy of the input of the layer before it.

    Other arguments (bound in `function`, as Hugging Face binds the attention mask, position
    ids and rotary cos/sin, or positional) stay where they are, referenced and not copied;
    they are shared by all layers. When one of them requires grad, or the first argument is
    not a tensor on a CPU or CUDA device, the call falls back to torch's non-reentrant
    checkpoint, which handles every case. Under no_grad (evaluation) `function` just runs.
    """

    def __init__(self) -> None:
        self.pool = _PinnedPool()
        self._copy_streams: dict[torch.device, torch.cuda.Stream] = {}
        self._kept: list[weakref.ref[_KeptInput]] = []  # forward order; a backward removes its own
        self._lock = threading.RLock()  # re-entered when a freed graph's __del__ gives back a buffer
        # Makes every checkpointed output require grad, so that a layer whose input does not
        # (the first layer without enable_input_require_grads) still gets its backward and
        # its LoRA gradients.
        self._grad_anchor = torch.empty(0, requires_grad=True)

    @property
    def pinned_bytes(self) -> int:
        """Bytes of pinned host memory allocated so far (in use or free in the pool)."""
        return self.pool.allocated_bytes

    def copy_stream(self, device: torch.device) -> torch.cuda.Stream:
        with self._lock:
            if device not in self._copy_streams:
                self._copy_streams[device] = torch.cuda.Stream(device)
            return self._copy_streams[device]

    def __call__(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return function(*args, **kwargs)
        if kwargs or not _offloadable(args) or _any_requires_grad(_bound_values(function), args[1:]):
            return torch_checkpoint(function, *args, use_reentrant=False, **kwargs)
        hidden_states, *rest = args
        anchor = self._grad_anchor if not hidden_states.requires_grad else None
        outputs = _OffloadedLayer.apply(self, function, hidden_states, anchor, *rest)
        return outputs if isinstance(outputs, torch.Tensor) else _unflatten(outputs)

    def _keep(self, tensor: torch.Tensor) -> _KeptInput:
        kept = _KeptInput(self, tensor)
        with self._lock:
            self._kept = [ref for ref in self._kept if ref() is not None]
            self._kept.append(weakref.ref(kept))
        return kept

    def _restore(self, kept: _KeptInput) -> torch.Tensor:
        """`kept`'s input on its device, after starting the copy of the one kept before it."""
        kept.fetch()
        with self._lock:
            live = [k for k in (ref() for ref in self._kept) if k is not None]
            position = next(i for i, k in enumerate(live) if k is kept)
            previous = live[position - 1] if position > 0 else None
            self._kept = [weakref.ref(k) for k in live if k is not kept]
        if previous is not None:
            previous.fetch()
        return kept.take()


class _OffloadedLayer(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        owner: OffloadedCheckpoint,
        function: Callable[..., Any],
        hidden_states: torch.Tensor,
        anchor: torch.Tensor | None,
        *rest: Any,
    ) -> Any:
        ctx.owner, ctx.function = owner, function
        ctx.rng = RngState(hidden_states.device)
        ctx.autocast = AutocastState(hidden_states.device)
        ctx.kept = owner._keep(hidden_states)  # its device-to-host copy overlaps the compute below
        tensor_rest = [i for i, value in enumerate(rest) if isinstance(value, torch.Tensor)]
        ctx.rest = [None if i in tensor_rest else value for i, value in enumerate(rest)]
        ctx.tensor_rest = tensor_rest
        ctx.save_for_backward(*(rest[i] for i in tensor_rest))
        outputs = function(hidden_states, *rest)
        if isinstance(outputs, torch.Tensor):
            return outputs
        return _flatten(outputs)

    @staticmethod
    def backward(ctx: Any, *output_grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        needs_input_grad = ctx.needs_input_grad[2]
        x = ctx.owner._restore(ctx.kept).detach().requires_grad_(needs_input_grad)
        rest = list(ctx.rest)
        for i, tensor in zip(ctx.tensor_rest, ctx.saved_tensors):
            rest[i] = tensor
        with torch.enable_grad(), ctx.rng.restored(), ctx.autocast.replayed():
            outputs = ctx.function(x, *rest)
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        else:
            outputs = _flatten(outputs)
        tensors, grads = [], []
        for output, grad in zip(outputs, output_grads):
            if isinstance(output, torch.Tensor) and output.requires_grad and grad is not None:
                tensors.append(output)
                grads.append(grad)
        if tensors:
            torch.autograd.backward(tensors, grads)
        input_grad = x.grad if needs_input_grad else None
        return (None, None, input_grad, None) + (None,) * len(rest)


def _offloadable(args: tuple[Any, ...]) -> bool:
    return bool(args) and isinstance(args[0], torch.Tensor) and args[0].device.type in ("cpu", "cuda")


def _bound_values(function: Callable[..., Any]) -> list[Any]:
    """The arguments bound in a functools.partial (Hugging Face binds the layer's keyword
    arguments so)."""
    values: list[Any] = []
    while isinstance(function, functools.partial):
        values += [*function.args, *function.keywords.values()]
        function = function.func
    return values


def _tensors_in(values: Any) -> Iterator[torch.Tensor]:
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (tuple, list)):
            yield from _tensors_in(value)
        elif isinstance(value, dict):
            yield from _tensors_in(value.values())


def _any_requires_grad(*groups: Any) -> bool:
    """Whether an argument other than the offloaded input requires grad: its gradient would
    need the outer graph, which torch's own checkpoint keeps."""
    return any(tensor.requires_grad for group in groups for tensor in _tensors_in(group))


# A layer's tuple output may hold nested tuples (and None): autograd.Function returns a flat
# tuple, so the structure travels as a marker object at its end.
class _Structure:
    def __init__(self, template: Any) -> None:
        self.template = template


def _flatten(outputs: Any) -> tuple[Any, ...]:
    leaves: list[Any] = []

    def walk(value: Any) -> Any:
        if isinstance(value, tuple):
            return tuple(walk(v) for v in value)
        leaves.append(value)
        return len(leaves) - 1

    template = walk(outputs)
    return (*leaves, _Structure(template))


def _unflatten(flat: tuple[Any, ...]) -> Any:
    *leaves, structure = flat

    def build(template: Any) -> Any:
        if isinstance(template, tuple):
            return tuple(build(t) for t in template)
        return leaves[template]

    return build(structure.template)


class RngState:
    """The CPU RNG state and, for a CUDA input, its device's, as the forward found them; the
    recompute runs from them (the same dropout masks) inside a fork, so that the RNG after
    the backward is what it would be without checkpointing."""

    def __init__(self, device: torch.device) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda_device = device.index if device.type == "cuda" else None
        self.cuda = torch.cuda.get_rng_state(self.cuda_device) if self.cuda_device is not None else None

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        devices = [self.cuda_device] if self.cuda_device is not None else []
        with torch.random.fork_rng(devices=devices, device_type="cuda"):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.cuda_device)
            yield


class AutocastState:
    """The autocast settings of the forward (the input's device type and the CPU's), which the
    recompute replays: the backward runs outside the autocast region."""

    def __init__(self, device: torch.device) -> None:
        device_types = ["cpu"] + (["cuda"] if device.type == "cuda" else [])
        self.settings = [
            dict(
                device_type=device_type,
                enabled=torch.is_autocast_enabled(device_type),
                dtype=torch.get_autocast_dtype(device_type),
                cache_enabled=torch.is_autocast_cache_enabled(),
            )
            for device_type in device_types
        ]

    @contextlib.contextmanager
    def replayed(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for settings in self.settings:
                stack.enter_context(torch.autocast(**settings))
            yield
