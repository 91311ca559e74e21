"""BarqTrain's measuring package: benchmarks side by side with the baselines, measured in one run.

It imports barqtrain and is never imported by it: the product reaches it only as the `barqtrain
bench` command, which `barqtrain.cli` finds through the entry point group "barqtrain.commands"
(pyproject.toml). Without this package installed, `barqtrain` simply has no `bench` command.

Modules:
command.py      the `barqtrain bench` command (argparse only; the suites load when it runs)
ops.py          per-op suite: ceilings, then each op case against the baselines
op_cases/       each op's shapes, byte counts and implementations
ceilings.py     copy bandwidth and matmul rate of the GPU
timing.py       CUDA-event medians with inputs rotated past L2
xent.py         fused linear + cross-entropy: time and memory
attention.py    attention against SDPA's flash and cuDNN backends
lora.py         the LoRA linear and a decoder layer against PEFT
qlora.py        NF4 dequantization, the 4-bit GEMM and the QLoRA linear
e2e.py          end-to-end suite: one worker process per (model, variant)
e2e_worker.py   one variant: build, patch, LoRA, train, measure (python -m barqtrain_bench.e2e_worker)
profile.py      a variant's kernel time per step by category (e2e --profile)
scaling.py      several-GPU suite: one torchrun launch per (case, variant, GPU count)
scaling_worker.py  one rank of a launch: build layer by layer, spread, train, measure
models.py       the model shapes and workloads
data_wait.py    how long a training step waits for its batch (bench data)
tokenizer.py    tokenizer throughput against HF tokenizers and tiktoken (python -m barqtrain_bench.tokenizer)
packing.py      packer and collation throughput (python -m barqtrain_bench.packing)
environment.py  device, versions, commit and command of a result; optional imports
report.py       tables, JSON and charts
"""
