"""`barqtrain bench`: benchmarks side by side with the baselines, measured in one run.

Modules:
command.py      the CLI command
ops.py          per-op suite: ceilings, then each op case against the baselines
op_cases/       each op's shapes, byte counts and implementations
ceilings.py     copy bandwidth and matmul rate of the GPU
timing.py       CUDA-event medians with inputs rotated past L2
e2e.py          end-to-end suite: one worker process per (model, variant)
e2e_worker.py   one variant: build, patch, LoRA, train, measure
profile.py      a variant's kernel time per step by category (e2e --profile)
models.py       the model shapes and workloads
environment.py  device, versions, commit and command of a result; optional imports
report.py       tables, JSON and charts
"""
