"""The training step replayed from a CUDA graph (the `cuda_graph: true` of a training config).

Why: an eager LoRA step of a 1B model launches about 2,250 kernels, and the host's Python,
autograd and dispatch for them take about as long as the kernels, so the GPU waits between them
(12.3 ms of a 104.5 ms step at the Llama-3.2-1B shape on an H200). Captured once per batch shape,
the whole step (forward and backward of every micro-batch, gradient clipping, the optimizer's
update) costs the host one launch: 97.4 ms, 3.1 ms of it idle (`barqtrain bench e2e --profile
--variants barqtrain,barqtrain+graph`).

What a replay assumes, and how it holds:
- the same tensors every step: the micro-batches are copied into buffers the graph reads;
  parameters, gradients, optimizer state and the learning rate stay where the capture found
  them (the learning rate becomes a one-element tensor on the GPU, which LR schedulers fill in
  place; the gradients of each graph are kept alive for its replays);
- an update computed on the GPU: torch.optim.AdamW with capturable=True counts its steps on
  the device (bitsandbytes' 8-bit AdamW, fp16 loss scaling and DDP's bucketed all-reduce read
  values back to the host and are refused by the config);
- nothing reads a value back inside the step: the fused loss skips its label-range check while
  capturing (train() checks the labels against the vocabulary before the first step; an
  out-of-range label then gives its row a NaN loss);
- randomness (dropout) draws fresh numbers each replay: PyTorch's CUDA generator advances its
  offset per replay.

Each new batch shape runs `warmup_steps` eager steps first (lazy initialisation, cuBLAS
workspaces and the optimizer state must exist before a capture), then is captured; the graphs
share one memory pool. More than `max_graphs` shapes is an error: pad or pack the batches to
one length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from barqtrain.train.batches import scored_tokens
from barqtrain.train.distributed import backward_micro_batches

Batch = dict[str, torch.Tensor]


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: list[Batch]  # what the graph reads: each step's micro-batches are copied in
    num_items: torch.Tensor  # the step's scored tokens (int64, on the GPU)
    loss: torch.Tensor  # what the graph writes: the step's loss (float64)
    grads: list[torch.Tensor | None]  # the gradients the graph writes, kept alive for its replays


def _shape_key(micro_batches: Sequence[Batch]) -> tuple:
    return tuple(tuple((name, tuple(t.shape), t.dtype) for name, t in sorted(b.items())) for b in micro_batches)


class GraphedTrainStep:
    """One optimizer step of `model` over a list of micro-batches, replayed from CUDA graphs.

    step(micro_batches) does what the eager loop does: the token-weighted loss of every
    micro-batch (num_items_in_batch = the step's scored tokens), backward into the parameters'
    gradients, clipping to `max_grad_norm`, optimizer.step(), and zero_grad; it returns the
    step's loss. `optimizer` must be built with capturable=True.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        parameters: Sequence[torch.nn.Parameter],
        *,
        max_grad_norm: float | None = None,
        autocast_dtype: torch.dtype | None = None,
        warmup_steps: int = 2,
        max_graphs: int = 4,
    ) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("barqtrain: cuda_graph needs a CUDA GPU; set cuda_graph: false")
        self.parameters = list(parameters)
        self.device = self.parameters[0].device
        if self.device.type != "cuda":
            raise RuntimeError(f"barqtrain: cuda_graph needs the model on a CUDA GPU, not {self.device}")
        if not all(group.get("capturable", False) for group in optimizer.param_groups):
            raise ValueError(
                f"barqtrain: cuda_graph needs an optimizer that updates on the GPU (torch.optim.AdamW with "
                f"capturable=True); {type(optimizer).__name__} is not built so"
            )
        for group in optimizer.param_groups:
            # A float would be baked into the graph; a tensor is read at each replay.
            if not isinstance(group["lr"], torch.Tensor):
                group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=self.device)
        if warmup_steps < 1:
            raise ValueError(f"barqtrain: warmup_steps must be at least 1, got {warmup_steps}")
        self.model = model
        self.optimizer = optimizer
        self.max_grad_norm = max_grad_norm
        self.autocast_dtype = autocast_dtype
        self.warmup_steps = warmup_steps
        self.max_graphs = max_graphs
        self._eager_steps: dict[tuple, int] = {}
        self._graphs: dict[tuple, _Captured] = {}
        self._pool = None

    @property
    def graphs(self) -> int:
        """How many batch shapes have been captured."""
        return len(self._graphs)

    def step(self, micro_batches: Sequence[Batch]) -> float:
        count = max(1, sum(scored_tokens(batch["labels"]) for batch in micro_batches))
        key = _shape_key(micro_batches)
        captured = self._graphs.get(key)
        if captured is None:
            done = self._eager_steps.get(key, 0)
            if done < self.warmup_steps:
                self._eager_steps[key] = done + 1
                return self._eager_step(micro_batches, count)
            if len(self._graphs) == self.max_graphs:
                shapes = ", ".join(str([list(t.shape) for t in b.values()][0]) for b in micro_batches)
                raise RuntimeError(
                    f"barqtrain: cuda_graph: a batch of a new shape ({shapes}) after {self.max_graphs} captured "
                    "shapes; pack or pad the batches to one length (data.packing, data.seq_length) or set "
                    "cuda_graph: false"
                )
            captured = self._capture(micro_batches, key)
        for static, batch in zip(captured.inputs, micro_batches, strict=True):
            for name, tensor in batch.items():
                static[name].copy_(tensor, non_blocking=True)
        captured.num_items.fill_(count)
        captured.graph.replay()
        self.optimizer.zero_grad(set_to_none=True)
        return float(captured.loss)

    def _run(self, micro_batches: Sequence[Batch], num_items: torch.Tensor) -> torch.Tensor:
        """The step's work on the GPU, the same eager or under capture; returns its loss."""
        # Autocast's cache of cast weights would be freed after the capture and read by replays.
        autocast = None
        if self.autocast_dtype is not None:
            autocast = torch.autocast("cuda", dtype=self.autocast_dtype, cache_enabled=False)
        step_loss = backward_micro_batches(self.model, micro_batches, num_items, self.device, autocast=autocast)
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.parameters, self.max_grad_norm, foreach=True)
        self.optimizer.step()
        return step_loss

    def _eager_step(self, micro_batches: Sequence[Batch], count: int) -> float:
        # On a side stream, as a capture's warm-up must be (the capture runs on one too).
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            num_items = torch.tensor(count, dtype=torch.int64, device=self.device)
            loss = self._run(micro_batches, num_items)
            self.optimizer.zero_grad(set_to_none=True)
        torch.cuda.current_stream(self.device).wait_stream(side)
        return float(loss)

    def _capture(self, micro_batches: Sequence[Batch], key: tuple) -> _Captured:
        inputs = [{name: torch.empty_like(t, device=self.device) for name, t in batch.items()} for batch in micro_batches]
        num_items = torch.ones((), dtype=torch.int64, device=self.device)
        # Every gradient is made by the captured backward, in the graph's memory.
        self.optimizer.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            loss = self._run(inputs, num_items)
        self._pool = graph.pool()
        captured = _Captured(graph, inputs, num_items, loss, [p.grad for p in self.parameters])
        self._graphs[key] = captured
        return captured
