#!/usr/bin/env bash
# The several-GPU check: the data-parallel tests (tests/python/train/test_distributed.py) with
# NCCL, one GPU per process, for DDP and FSDP2, LoRA and full fine-tuning: N processes learn
# what one process with N times the batch learns, and a stopped run resumes to the same losses.
# It runs at world sizes 1, 2, 4 and 8, as far as the machine has GPUs, so it runs on one GPU
# too (world size 1: torchrun's single process trains without a process group of its own).
# Logs, the pytest JUnit XML and summary.json land in OUTDIR.
#
#   scripts/multi_gpu_check.sh OUTDIR
#   WORLD_SIZES=2 scripts/multi_gpu_check.sh OUTDIR     # only 2 processes
#
# It needs an installed BarqTrain with its CUDA kernels (PHASES=build scripts/gpu_check.sh OUTDIR
# builds and installs it).
set -uo pipefail

OUTDIR=$(realpath -m "${1:?usage: scripts/multi_gpu_check.sh OUTDIR}")
PYTHON=${PYTHON:-python3}
REPO=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUTDIR"
LOG="$OUTDIR/multi_gpu_check.log"
export BARQTRAIN_REQUIRE_GPU=1 PYTHONUNBUFFERED=1

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

start=$SECONDS
(
  cd /tmp &&
    BARQTRAIN_DISTRIBUTED_DEVICE=cuda BARQTRAIN_DISTRIBUTED_WORLD_SIZES=${WORLD_SIZES// /,} \
      $PYTHON -m pytest -v -p no:cacheprovider "$REPO/tests/python/train/test_distributed.py" \
      --junitxml="$OUTDIR/pytest.xml"
) >>"$LOG" 2>&1
status=$?
outcome=$([[ $status -eq 0 ]] && echo PASS || echo FAIL)
sizes_json="[${WORLD_SIZES// /, }]"
printf '{"outcome": "%s", "gpus": %d, "world_sizes": %s, "seconds": %d}\n' \
  "$outcome" "$GPUS" "$sizes_json" "$((SECONDS - start))" >"$OUTDIR/summary.json"
echo "$outcome  test_distributed.py with NCCL at world sizes $WORLD_SIZES ($((SECONDS - start)) s); log: $LOG" | tee -a "$LOG"
exit $status
