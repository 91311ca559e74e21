#!/usr/bin/env bash
# The several-GPU check, in two steps, at world sizes 1, 2, 4 and 8 as far as the machine has
# GPUs (so it runs on one GPU too):
#  1. the data-parallel tests (tests/python/train/test_distributed.py) with NCCL, one GPU per
#     process, for DDP and FSDP2, LoRA and full fine-tuning: N processes learn what one process
#     with N times the batch learns, and a stopped run resumes to the same losses (at world size
#     1 torchrun's single process trains without a process group of its own);
#  2. `barqtrain bench scaling` at the same GPU counts: tokens/s and peak memory per GPU for the
#     Llama-3.1-8B shape (LoRA, QLoRA) and a Llama-3-70B shape (QLoRA), beside HF + PEFT under
#     Accelerate's FSDP2, a few steps each, within SCALING_BUDGET_S seconds (points not started
#     by then are reported as skipped): about 6 minutes on 2 GPUs.
# Logs, the pytest JUnit XML, summary.json and scaling/ (scaling.json, scaling.md and a log per
# launch) land in OUTDIR. NVLink multicast stays off in everything it starts.
#
#   scripts/multi_gpu_check.sh OUTDIR
#   WORLD_SIZES=2 scripts/multi_gpu_check.sh OUTDIR                      # only 2 processes
#   SCALING_ARGS="--cases llama-70b-qlora --steps 5" scripts/multi_gpu_check.sh OUTDIR
#   SCALING_BUDGET_S=1800 scripts/multi_gpu_check.sh OUTDIR               # every point, more time
#   STEPS=scaling scripts/multi_gpu_check.sh OUTDIR                       # the benchmark only
#
# SCALING_ARGS: more `barqtrain bench scaling` options, after the script's own (so they win):
# --cases, --steps, --warmup, --strategy, --compare none. It needs an installed BarqTrain with
# its CUDA kernels (PHASES=build scripts/gpu_check.sh OUTDIR builds and installs it).
set -uo pipefail

OUTDIR=$(realpath -m "${1:?usage: scripts/multi_gpu_check.sh OUTDIR}")
PYTHON=${PYTHON:-python3}
REPO=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUTDIR"
LOG="$OUTDIR/multi_gpu_check.log"
export BARQTRAIN_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
# NVLink multicast off in NCCL, PyTorch's symmetric memory and NVSHMEM, for every process started
# here: on shared machines a program that uses it can take the host's GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SCALING_ARGS=${SCALING_ARGS:-}
STEPS=${STEPS:-"tests scaling"}  # which of the two steps run
for step in $STEPS; do
  if [[ $step != tests && $step != scaling ]]; then
    echo "multi_gpu_check: STEPS: 'tests' and/or 'scaling', got '$step'" >&2
    exit 2
  fi
done
SCALING_BUDGET_S=${SCALING_BUDGET_S:-360}
# The 70B shape comes second: the budget must reach it; the 8B shape's QLoRA is the case it may cut.
SCALING_DEFAULTS="--cases llama-8b-lora,llama-70b-qlora,llama-8b-qlora --steps 3 --warmup 1"

if ! GPUS=$(cd /tmp && $PYTHON -c "import barqtrain, torch; print(torch.cuda.device_count())" 2>>"$LOG"); then
  echo "multi_gpu_check: cannot import barqtrain and torch with $PYTHON (see $LOG); build and install it first:" \
    "PHASES=build scripts/gpu_check.sh OUTDIR" >&2
  exit 2
fi
if [[ $GPUS -lt 1 ]]; then
  echo "multi_gpu_check: torch sees no CUDA GPU; run it on a GPU machine" >&2
  exit 2
fi
if [[ -z ${WORLD_SIZES:-} ]]; then
  WORLD_SIZES=""
  for size in 1 2 4 8; do
    [[ $size -le $GPUS ]] && WORLD_SIZES+="${WORLD_SIZES:+ }$size"
  done
fi

{
  echo "date: $(date -u +%FT%TZ)  commit: ${BARQTRAIN_GIT_COMMIT:-$(git -C "$REPO" rev-parse HEAD 2>/dev/null || echo unknown)}"
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
  $PYTHON -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', '.'.join(map(str, torch.cuda.nccl.version())))"
  echo "GPUs: $GPUS; world sizes: $WORLD_SIZES"
} 2>&1 | tee "$LOG"

status=0 outcome=SKIPPED test_seconds=0
if [[ " $STEPS " == *" tests "* ]]; then
  start=$SECONDS
  (
    cd /tmp &&
      BARQTRAIN_DISTRIBUTED_DEVICE=cuda BARQTRAIN_DISTRIBUTED_WORLD_SIZES=${WORLD_SIZES// /,} \
        $PYTHON -m pytest -v -p no:cacheprovider "$REPO/tests/python/train/test_distributed.py" \
        --junitxml="$OUTDIR/pytest.xml"
  ) >>"$LOG" 2>&1
  status=$?
  test_seconds=$((SECONDS - start))
  outcome=$([[ $status -eq 0 ]] && echo PASS || echo FAIL)
  echo "$outcome  test_distributed.py with NCCL at world sizes $WORLD_SIZES ($test_seconds s); log: $LOG" | tee -a "$LOG"
fi

scaling_status=0 scaling_outcome=SKIPPED scaling_seconds=0
if [[ " $STEPS " == *" scaling "* ]]; then
  # A failed point is a row of scaling.json with its error, not a failure of this step; the step
  # fails when the benchmark itself cannot run (a usage error, a crash).
  start=$SECONDS
  # shellcheck disable=SC2086  # the options are meant to split into words
  (
    cd /tmp &&
      $PYTHON -m barqtrain.cli bench scaling --out "$OUTDIR/scaling" --gpus "${WORLD_SIZES// /,}" \
        --time-budget "$SCALING_BUDGET_S" $SCALING_DEFAULTS $SCALING_ARGS
  ) 2>&1 | tee -a "$LOG"
  scaling_status=${PIPESTATUS[0]}
  scaling_seconds=$((SECONDS - start))
  scaling_outcome=$([[ $scaling_status -eq 0 ]] && echo PASS || echo FAIL)
  echo "$scaling_outcome  bench scaling at $WORLD_SIZES GPUs ($scaling_seconds s): $OUTDIR/scaling/scaling.md" |
    tee -a "$LOG"
fi

sizes_json="[${WORLD_SIZES// /, }]"
scaling_json=$(printf '{"outcome": "%s", "seconds": %d}' "$scaling_outcome" "$scaling_seconds")
printf '{"outcome": "%s", "gpus": %d, "world_sizes": %s, "seconds": %d, "scaling": %s}\n' \
  "$outcome" "$GPUS" "$sizes_json" "$test_seconds" "$scaling_json" >"$OUTDIR/summary.json"
[[ $status -eq 0 && $scaling_status -eq 0 ]]
