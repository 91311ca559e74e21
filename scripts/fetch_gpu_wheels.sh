#!/usr/bin/env bash
# Fills .whl/ with the wheels that scripts/gpu_check.sh installs on a GPU machine without network:
# what the tests need and such a machine's image (torch, Transformers, PEFT) lacks, at the pins of
# requirements-dev.txt; with --baselines also what `barqtrain bench e2e --compare liger,unsloth`
# imports (Liger Kernel, Unsloth and Unsloth's dependencies). For CPython 3.12 on x86-64 Linux.
# bitsandbytes keeps only its CPU and CUDA 13 libraries, and Unsloth's wheel leaves out its web UI
# (studio/), which training never imports: 42 MB and 28 MB less to copy.
#
#   scripts/fetch_gpu_wheels.sh               # needs pip with network
#   scripts/fetch_gpu_wheels.sh --baselines
set -euo pipefail
cd "$(dirname "$0")/.."

pinned() {  # the version requirements-dev.txt pins NAME to
  grep -E "^$1==" requirements-dev.txt || { echo "fetch_gpu_wheels.sh: no pin for $1 in requirements-dev.txt" >&2; exit 1; }
}

wheels=("$(pinned nvidia-cutlass)" "$(pinned bitsandbytes)" "$(pinned gguf)")
if [[ ${1:-} == --baselines ]]; then
  # The versions the side-by-side benchmarks ran with.
  wheels+=(liger-kernel==0.8.5 unsloth==2026.10.9 unsloth-zoo==2026.10.9 trl==1.15.0 datasets==4.8.5
    cut_cross_entropy==25.1.1 dill==0.4.1 multiprocess==0.70.19 tyro==1.0.17 docstring-parser==0.18.0
    typeguard==4.6.1 shtab==1.13.0 msgspec==0.23.0 nest_asyncio==1.6.0 pydantic==2.14.4 pydantic-core==2.50.5
    annotated-types==0.8.0 typing-inspection==0.4.5)
elif [[ $# -gt 0 ]]; then
  echo "usage: scripts/fetch_gpu_wheels.sh [--baselines]" >&2
  exit 2
fi

download=$(mktemp -d)
trap 'rm -rf "$download"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$download" "${wheels[@]}"

mkdir -p .whl
python3 - "$download" .whl <<'SLIM'
import sys
import zipfile
from pathlib import Path

source, destination = map(Path, sys.argv[1:])
# What each wheel leaves out: bitsandbytes' libraries for other CUDA and ROCm versions, Unsloth's web UI.
left_out = {
    "bitsandbytes": lambda name: name.endswith(".so") and "cuda130" not in name and "_cpu" not in name,
    "unsloth": lambda name: name.startswith("studio/"),
}
for wheel in sorted(source.glob("*.whl")):
    drop = left_out.get(wheel.name.split("-")[0], lambda name: False)
    with zipfile.ZipFile(wheel) as original, zipfile.ZipFile(destination / wheel.name, "w", zipfile.ZIP_DEFLATED) as slim:
        for item in original.infolist():
            if not drop(item.filename):
                slim.writestr(item, original.read(item.filename))
    print(f"{wheel.name}: {(destination / wheel.name).stat().st_size / 2**20:.1f} MiB")
SLIM
