#!/usr/bin/env bash
# The GPU check: on a GPU machine with torch preinstalled and no network, build BarqTrain,
# run the C++ kernel tests, the Python test suite (GPU tests must run: a skip is a
# failure), compute-sanitizer, and the benchmarks. Logs and JSON land in OUTDIR.
#
#   scripts/gpu_check.sh OUTDIR            # every phase
#   PHASES="build cpp python" scripts/gpu_check.sh OUTDIR
#   PYTEST_ARGS="-m gpu" scripts/gpu_check.sh OUTDIR   # only the GPU tests (CI runs the rest)
#   PHASES="build bench-e2e" E2E_ARGS="--profile --models llama-1b" scripts/gpu_check.sh OUTDIR
#
# Wheels the machine lacks (e.g. liger-kernel, nvidia-cutlass for the CUTLASS headers) are
# installed from .whl/ when present (scripts/fetch_gpu_wheels.sh fills it); GoogleTest is built from .deps/googletest when no
# installed copy is found; PCRE2 (the tokenizer's regex engine) is linked from .deps/pcre2,
# which scripts/fetch_pcre2.sh fills on a machine with apt, when the machine lacks libpcre2-dev. On an sm_90 GPU both builds must include the Hopper kernels
# (sm_90 runs them by default): a build without them fails here instead of passing the
# check on the sm_80 path alone.
set -uo pipefail

OUTDIR=$(realpath -m "${1:?usage: scripts/gpu_check.sh OUTDIR}")
PHASES=${PHASES:-"build cpp python train sanitize bench-ops bench-xent bench-attn bench-lora bench-qlora bench-data bench-e2e bench-context"}
PYTHON=${PYTHON:-python3}
CUDA_ARCHS=${CUDA_ARCHS:-"80;90a"}
REPO=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUTDIR"
LOG="$OUTDIR/gpu_check.log"
SUMMARY=()
FAILED=0
export BARQTRAIN_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
cd "$REPO"
# Pass the commit from the machine that launches this script: the GPU machine's copy of the tree
# may carry no .git or a stale one.
export BARQTRAIN_GIT_COMMIT=${BARQTRAIN_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}

phase() {  # phase NAME COMMAND...: run, log, record the outcome
  local name=$1; shift
  [[ " $PHASES " == *" $name "* ]] || return 0
  local start=$SECONDS
  echo "=== $name: $*" | tee -a "$LOG"
  if "$@" >>"$LOG" 2>&1; then
    SUMMARY+=("PASS  $name ($((SECONDS - start)) s)")
  else
    SUMMARY+=("FAIL  $name ($((SECONDS - start)) s), see gpu_check.log")
    FAILED=1
  fi
}

{
  echo "date: $(date -u +%FT%TZ)  commit: $BARQTRAIN_GIT_COMMIT"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PYTHON -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
} | tee "$LOG"

if compgen -G ".whl/*.whl" >/dev/null; then
  # By name, so that .whl/ may hold one wheel per Python version and pip picks the one that fits.
  mapfile -t wheel_names < <(ls .whl/*.whl | xargs -n1 basename | cut -d- -f1 | sort -u)
  $PYTHON -m pip install -q --no-index --no-deps --no-compile --find-links .whl --target /tmp/barqtrain_wheels \
    "${wheel_names[@]}" >>"$LOG" 2>&1
  export PYTHONPATH=/tmp/barqtrain_wheels${PYTHONPATH:+:$PYTHONPATH}
fi
# CMake looks the CUTLASS headers up through this Python's cutlass_library.
$PYTHON -c "import cutlass_library, os; print('CUTLASS headers:', os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))" 2>&1 | tee -a "$LOG"
HOPPER_GPU=$($PYTHON -c "import torch; print(int(torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)))")
HOPPER_CMAKE_ARGS=()
HOPPER_PIP_ARGS=()
if [[ $HOPPER_GPU == 1 ]]; then  # without the headers CMake stops with the reason
  HOPPER_CMAKE_ARGS=(-DBARQTRAIN_ENABLE_HOPPER_KERNELS=ON)
  HOPPER_PIP_ARGS=(-Ccmake.define.BARQTRAIN_ENABLE_HOPPER_KERNELS=ON)
fi

# On an sm_90 GPU the installed package must run the Hopper attention kernel when named.
check_package_hopper_kernel() {
  [[ $HOPPER_GPU == 1 ]] || return 0
  (cd /tmp && $PYTHON - <<'HOPPER_IN_PACKAGE'
import torch, barqtrain
q = torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16)
o, _ = torch.ops.barqtrain.attention_forward(q, q, q, None, None, 128, 128, 0.125, 0.0, True, -1, -1, None, None, None,
                                             forward_kernel="hopper")
assert torch.isfinite(o).all(), "the Hopper attention kernel wrote non-finite values"
print("the package runs the Hopper attention kernel")
HOPPER_IN_PACKAGE
  )
}

# One CMake build directory for the package and the C++ tests, as in the Makefile: the cpp phase
# configures the package's build again with the tests on, so each kernel compiles once (a second
# directory compiled every kernel again).
GPU_BUILD=build/gpu

build_package() {
  $PYTHON -m pip install -v --no-build-isolation --no-deps --no-index -Cbuild-dir="$GPU_BUILD" \
    -Ccmake.define.BARQTRAIN_CUDA_ARCHITECTURES="$CUDA_ARCHS" "${HOPPER_PIP_ARGS[@]}" . &&
    (cd /tmp && $PYTHON -c "import barqtrain, barqtrain._op_library as n; assert n.has_cuda_kernels(), 'no CUDA kernels in the build'") &&
    check_package_hopper_kernel
}

build_and_run_cpp_tests() {
  local gtest_args=()
  [[ -d .deps/googletest ]] && gtest_args=(-DBARQTRAIN_GTEST_SOURCE_DIR="$REPO/.deps/googletest")
  # Without the build phase's directory, a configuration of its own (the same options).
  local first_configure=()
  [[ -f $GPU_BUILD/CMakeCache.txt ]] || first_configure=(-G Ninja -DPython_EXECUTABLE="$(command -v "$PYTHON")")
  cmake -S . -B "$GPU_BUILD" "${first_configure[@]}" -DBARQTRAIN_BUILD_TESTS=ON \
    -DBARQTRAIN_CUDA_ARCHITECTURES="$CUDA_ARCHS" "${HOPPER_CMAKE_ARGS[@]}" "${gtest_args[@]}" &&
    cmake --build "$GPU_BUILD" -j "$(nproc)" &&
    "$GPU_BUILD"/barqtrain_kernel_tests --gtest_output="json:$OUTDIR/gtest.json"
}

run_python_tests() {
  # PYTEST_ARGS is split into words on purpose: it holds pytest options.
  # shellcheck disable=SC2086
  (cd /tmp && $PYTHON -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-} "$REPO/tests/python" --junitxml="$OUTDIR/pytest.xml")
}

# barqtrain train on the GPU: `barqtrain train` with no arguments (the embedded default, which
# must learn the task), then LoRA and QLoRA on the Llama-3.2-1B shape, 30 steps of 4 rows of
# 2048 tokens (the task packed). Each run's config.yaml, metrics.jsonl and training.png land
# in OUTDIR/train/RUN/, and a summary of all (tokens/s, peak memory, losses, accuracy) in
# OUTDIR/train/summary.json. The weights and checkpoints stay in /tmp.
run_trainer() {
  local scratch=/tmp/barqtrain-train-check
  rm -rf "$scratch" "$OUTDIR/train" && mkdir -p "$scratch" "$OUTDIR/train" || return 1
  # tests/python/train/test_named_models.py loads this config.
  cat >"$scratch/llama-1b-shape.yaml" <<'LLAMA_1B_SHAPE_RUN'
model: {name: llama-1b-shape}
data: {seq_length: 2048}
lora: {r: 16, alpha: 32.0, target_modules: all-linear}
optim: {lr: 0.0002, warmup_steps: 5}
batch_size: 4
steps: 30
eval_interval: 0
save_interval: 0
log_interval: 5
LLAMA_1B_SHAPE_RUN
  { cat "$scratch/llama-1b-shape.yaml"; echo "method: qlora"; } >"$scratch/llama-1b-shape-qlora.yaml"
  (cd "$scratch" && $PYTHON -m barqtrain.cli train) &&
    (cd "$scratch" && $PYTHON -m barqtrain.cli train llama-1b-shape.yaml --output-dir runs/llama-1b-shape-lora) &&
    (cd "$scratch" && $PYTHON -m barqtrain.cli train llama-1b-shape-qlora.yaml --output-dir runs/llama-1b-shape-qlora) &&
    $PYTHON - "$scratch/runs" "$OUTDIR/train" <<'SUMMARY'
import json, shutil, sys
from pathlib import Path

from barqtrain.train.metrics import read_records, summarize

runs, out = map(Path, sys.argv[1:])
summary = {run.name: summarize(read_records(run)) for run in sorted(runs.iterdir())}
for run in summary:
    (out / run).mkdir()
    for name in ("config.yaml", "metrics.jsonl", "training.png"):
        shutil.copy(runs / run / name, out / run / name)
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print(json.dumps(summary, indent=1))
default = summary["default"]
if not default["accuracy_first"] < 0.3 < 0.6 < default["accuracy_last"]:
    sys.exit(f"the embedded default did not learn: accuracy {default['accuracy_first']} -> {default['accuracy_last']}")
SUMMARY
}

# memcheck and racecheck over a representative subset: every tiling path of every kernel that
# runs by default (on sm_90 the Hopper dequant-GEMM and the Hopper attention kernels among them:
# forward and backward, packed, cross lengths, a padded head_dim with a window and softcap, RoPE
# rotated ahead).
run_sanitizers() {
  local filter='*bfloat16_rows37_hidden4096_pad0_rmsnorm_llama*:*bfloat16_rows3001*:*float32_rows19_hidden1001*:*float16_rows5_hidden3999*:*bfloat16_rows2001_hidden1000*:*layernorm_gemma_bias*:*Glu*fused*:*Rope*inplace*:*CrossEntropy*rows33*:*CrossEntropy*rows4_*:*AttentionKernel*rope_partial_packed*:*AttentionKernel*cross_lengths*:*AttentionKernel*d256_forward_rope*:*AllShapes/AttentionKernel*bf16_packed_many_short*:*AllShapes/AttentionKernel*fp16_d64_full_s17*:*Nf4Gemm*m301*:*Int8Gemm*m77*:*Dequantize4bit*DoubleQuantized*:*AttentionKernel*hopper_bwd_bf16_packed_many_short*:*AttentionKernel*hopper_bwd_*d32_packed*'
  compute-sanitizer --tool memcheck --error-exitcode 1 "$GPU_BUILD"/barqtrain_kernel_tests --gtest_filter="$filter" &&
    compute-sanitizer --tool racecheck --error-exitcode 1 "$GPU_BUILD"/barqtrain_kernel_tests --gtest_filter="$filter"
}

phase build build_package
phase cpp build_and_run_cpp_tests
phase python run_python_tests
phase train run_trainer
phase sanitize run_sanitizers
phase bench-ops bash -c "cd /tmp && $PYTHON -m barqtrain.cli bench ops --out '$OUTDIR/bench'"
phase bench-xent bash -c "cd /tmp && $PYTHON -m barqtrain.cli bench xent --out '$OUTDIR/bench'"
phase bench-attn bash -c "cd /tmp && $PYTHON -m barqtrain.cli bench attn --out '$OUTDIR/bench'"
phase bench-lora bash -c "cd /tmp && $PYTHON -m barqtrain.cli bench lora --out '$OUTDIR/bench'"
phase bench-qlora bash -c "cd /tmp && $PYTHON -m barqtrain.cli bench qlora --out '$OUTDIR/bench'"
phase bench-data bash -c "cd /tmp && $PYTHON -m barqtrain.cli bench data --out '$OUTDIR/bench'"
# E2E_ARGS: extra `bench e2e` options (models, variants, --profile, --tokenizer for Unsloth).
phase bench-e2e bash -c "cd /tmp && $PYTHON -m barqtrain.cli bench e2e ${E2E_ARGS:-} --out '$OUTDIR/bench'"
# CONTEXT_ARGS: the `bench context` ladder (default: 32K and 64K tokens, LoRA and QLoRA, beside HF + PEFT,
# under an 80 GiB cap: some 6 minutes); e.g. "--lengths 400000 --methods lora --compare none --attempt-steps 1".
phase bench-context bash -c "cd /tmp && $PYTHON -m barqtrain.cli bench context \
  ${CONTEXT_ARGS:---lengths 32768,65536 --compare hf} --out '$OUTDIR/bench'"

echo "=== summary" | tee -a "$LOG"
grep -h "BarqTrain: .*Hopper (sm_90a) kernels" "$LOG" | sort -u | tee -a "$LOG"
printf '%s\n' "${SUMMARY[@]}" | tee -a "$LOG"
exit $FAILED
