"""Whether a LoRA training step is bound by the host (Python and launches) or by the GPU.

One `bench e2e` workload (the Llama-3.2-1B shape by default) with BarqTrain's default patching,
on a GPU. After warm-up it times, per step, how long the host takes to enqueue the forward,
the backward and the optimizer step against the step's wall time: when the host's enqueue
time is close to the wall time, the GPU waits on Python, and fewer launches or less Python per
layer is what moves the step. Then a profiled step lists the operators by host time and the
kernels by launch count.

    python benchmarks/diagnostics/step_host_profile.py [--model llama-1b] [--steps 5]
"""

import argparse
import statistics
import time
from collections import Counter

import torch
from peft import LoraConfig

import barqtrain
from barqtrain_bench.e2e_worker import LORA_SETTINGS
from barqtrain_bench.models import WORKLOADS, build_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-1b", choices=sorted(WORKLOADS))
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    workload = WORKLOADS[args.model]
    torch.manual_seed(0)
    model = build_model(workload, torch.device("cuda"))
    if workload.gradient_checkpointing:
        barqtrain.enable_gradient_checkpointing(model, offload=True)
    model = barqtrain.get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **LORA_SETTINGS))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    generator = torch.Generator().manual_seed(0)
    shape = (workload.batch_size, workload.seq_len)
    ids = torch.randint(workload.config["vocab_size"], shape, generator=generator).cuda()

    def step() -> tuple[float, float, float]:
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return forward - start, backward - forward, time.perf_counter() - backward

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    rows = []
    for _ in range(args.steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        host = step()
        torch.cuda.synchronize()
        rows.append((*host, time.perf_counter() - start))
    forward, backward, optim, wall = (statistics.median(column) * 1e3 for column in zip(*rows))
    print(f"{args.model}: host enqueue forward {forward:.1f} ms, backward {backward:.1f} ms, "
          f"optimizer {optim:.1f} ms; host total {forward + backward + optim:.1f} ms; step wall {wall:.1f} ms")

    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        step()
        torch.cuda.synchronize()
    print(profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
    kernels = Counter(
        event.name for event in profile.events() if event.device_type == torch.autograd.DeviceType.CUDA
    )
    print(f"{sum(kernels.values())} kernels in the step; by launch count:")
    for name, count in kernels.most_common(40):
        print(f"  {count:5d}  {name[:150]}")


if __name__ == "__main__":
    main()
