#!/usr/bin/env bash
# The GPU checks in one go, sized for one H200 and about 8 minutes of wall time:
#   bash bench/gpu_check.sh [PYTHON]
# PYTHON: the argument, else $PYTHON, else .venv/bin/python where it exists, else python3 (a
# GPU machine's system Python with torch). Packages that Python lacks (megatron-core) are
# installed from the wheels in .gpu-wheels/ (GPU_CHECK_WHEELS), which `bash bench/gpu_wheels.sh`
# downloads on a machine that reaches the package registry, with pip --target into
# GPU_CHECK_SITE (default /tmp/gpu_check_site), put on PYTHONPATH.
#
# Each check is one pytest test (tests/gpu/, marked gpu) run in a pytest of its own under
# timeout(1) (its own limit, cut to what is left of GPU_CHECK_BUDGET_S, default 420 s, when
# that is less); one line each:
#   check NAME: passed (S s)  |  check NAME: not available: WHY  |  check NAME: FAILED (...): ...
# followed by the test's `measured:` lines. A test that skips (a package, a second GPU or FP8
# missing) is "not available" and does not count as passed. Last line:
#   gpu_check: N passed, M failed, K not available
# Without a GPU, or without the packages and their wheels, it says so and ends with
#   gpu_check: 0 passed, 1 failed, K not available     (K: every check)
# Logs: one per check in GPU_CHECK_LOG_DIR (default a new temporary folder).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -n "${1:-}" ]; then PYTHON=$1
elif [ -n "${PYTHON:-}" ]; then :
elif [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python
else PYTHON=python3; fi
WHEEL_DIR="${GPU_CHECK_WHEELS:-.gpu-wheels}"
SITE="${GPU_CHECK_SITE:-/tmp/gpu_check_site}"
BUDGET_S="${GPU_CHECK_BUDGET_S:-420}"
LOG_DIR="${GPU_CHECK_LOG_DIR:-$(mktemp -d -t gpu_check.XXXXXX)}"
mkdir -p "$LOG_DIR"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

# name, time limit (s), pytest node; in the order they run (one GPU's checks first)
CHECKS=(
  "weight_checksum_gpu 60 tests/gpu/test_weight_sync_gpu.py::test_weight_checksum_reads_gpu_tensors"
  "cuda_ipc_per_tensor 90 tests/gpu/test_tensor_handles_gpu.py::test_another_process_opens_the_cuda_ipc_handles[per_tensor]"
  "cuda_ipc_flattened_bucket 90 tests/gpu/test_tensor_handles_gpu.py::test_another_process_opens_the_cuda_ipc_handles[flattened_bucket]"
  "actor_vs_transformers 150 tests/gpu/test_actor_gpu.py::test_actor_logits_match_transformers"
  "actor_update_step 150 tests/gpu/test_actor_gpu.py::test_update_step_moves_the_loss_and_the_weights"
  "actor_resume_distributed_optimizer 180 tests/gpu/test_actor_gpu.py::test_distributed_optimizer_resume_keeps_adams_step"
  "colocated_cuda_ipc_sync 180 tests/gpu/test_colocated_sync_gpu.py::test_colocated_cuda_ipc_sync_to_the_embedded_engine"
  "fp8_quantize_fp32 90 tests/gpu/test_fp8_gpu.py::test_quantize_on_the_gpu_equals_the_cpu[fp32]"
  "fp8_quantize_bf16 90 tests/gpu/test_fp8_gpu.py::test_quantize_on_the_gpu_equals_the_cpu[bf16]"
  "fp8_colocated_sync 180 tests/gpu/test_fp8_gpu.py::test_fp8_sync_to_the_embedded_engine_on_the_gpu"
  "te_vs_local_spec 150 tests/gpu/test_transformer_engine.py::test_transformer_engine_matches_local_spec"
  "fp8_delayed 150 tests/gpu/test_transformer_engine.py::test_fp8_forward_backward[delayed]"
  "fp8_tensorwise 150 tests/gpu/test_transformer_engine.py::test_fp8_forward_backward[tensorwise]"
  "sglang_cuda_ipc_weight_sync 300 tests/gpu/test_weight_sync_gpu.py::test_cuda_ipc_weight_sync_to_a_real_sglang_server"
  "nccl_tp2 300 tests/gpu/test_transformer_engine.py::test_nccl_tensor_parallel"
  "nccl_tp2_sequence_parallel 300 tests/gpu/test_transformer_engine.py::test_nccl_sequence_parallel"
  "sglang_nccl_weight_sync 300 tests/gpu/test_weight_sync_gpu.py::test_nccl_weight_sync_to_a_real_sglang_server"
)
# what the GPU machine lacks and the checks import: pip name, then the module
WHEELS=("megatron-core megatron.core")

cannot_start() {
  echo "gpu_check: 0 passed, 1 failed, ${#CHECKS[@]} not available"
  exit 1
}

missing_modules() {  # the pip names of WHEELS whose module this Python cannot find
  "$PYTHON" - "${WHEELS[@]}" <<'EOF'
import importlib.util
import sys

for entry in sys.argv[1:]:
    package, module = entry.split()
    try:
        found = importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package that does not import
        found = False
    if not found:
        print(package)
EOF
}

"$PYTHON" -c "
import sys
try:
    import torch
except ImportError:
    sys.exit(3)
sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null
cuda=$?
[ $cuda -ne 3 ] || { echo "gpu_check: $PYTHON cannot import torch"; cannot_start; }
problems=0
mapfile -t missing < <(missing_modules)
if [ ${#missing[@]} -gt 0 ]; then
  if compgen -G "$WHEEL_DIR/*.whl" > /dev/null; then
    echo "gpu_check: installing ${missing[*]} from $WHEEL_DIR/ into $SITE"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "$WHEEL_DIR"/*.whl > "$LOG_DIR/pip.log" 2>&1 || echo "gpu_check: pip failed: $(tail -3 "$LOG_DIR/pip.log")"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    mapfile -t still < <(missing_modules)
    if [ ${#still[@]} -gt 0 ]; then
      echo "gpu_check: ${still[*]} still missing after installing $WHEEL_DIR/*.whl (log $LOG_DIR/pip.log)"
      problems=1
    fi
  else
    echo "gpu_check: $PYTHON lacks ${missing[*]} and $WHEEL_DIR/ holds no wheels: run \`bash bench/gpu_wheels.sh\`" \
         "on a machine that reaches the package registry (it fills $WHEEL_DIR/), then bring $WHEEL_DIR/ here"
    problems=1
  fi
fi
if [ $cuda -ne 0 ]; then
  echo "gpu_check: no CUDA device visible to $PYTHON: the checks need a GPU"
  problems=1
fi
[ $problems -eq 0 ] || cannot_start
"$PYTHON" - <<'EOF'
import importlib.util
import torch
names = ", ".join(sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}))
optional = {m: importlib.util.find_spec(m) is not None for m in ("transformer_engine", "sglang")}
print(f"gpu_check: {torch.cuda.device_count()} x {names}, torch {torch.__version__}, "
      + ", ".join(f"{m} {'installed' if ok else 'absent'}" for m, ok in optional.items()))
EOF

deadline=$(( $(date +%s) + BUDGET_S ))
passed=0; failed=0; unavailable=0
for check in "${CHECKS[@]}"; do
  read -r name limit node <<< "$check"
  log="$LOG_DIR/$name.log"
  left=$(( deadline - $(date +%s) ))
  if [ $left -lt 20 ]; then
    echo "check $name: FAILED (not run: the ${BUDGET_S} s budget is spent)"; failed=$((failed + 1)); continue
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  start=$(date +%s)
  timeout --kill-after=15 "$limit" "$PYTHON" -m pytest -q -s -rs -p no:cacheprovider "$node" > "$log" 2>&1
  rc=$?
  seconds=$(( $(date +%s) - start ))
  summary=$(grep -E '^=*[ ]*[0-9]+ (passed|failed|skipped|error|errors|deselected)' "$log" | tail -1)
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    echo "check $name: FAILED (timed out after ${limit} s; log $log)"; failed=$((failed + 1))
  elif [ $rc -eq 0 ] && [[ "$summary" =~ (^|[^0-9])1\ passed ]]; then
    echo "check $name: passed (${seconds} s)"; passed=$((passed + 1))
  elif [ $rc -eq 0 ] && [[ "$summary" =~ (^|[^0-9])1\ skipped ]]; then
    why=$(grep -m1 '^SKIPPED' "$log" | sed -E 's/^SKIPPED \[[0-9]+\] [^ ]+: //' | cut -c1-200)
    echo "check $name: not available: $why"; unavailable=$((unavailable + 1))
  else
    detail=$(grep -m1 -E '^E ' "$log" || grep -v '^\s*$' "$log" | tail -1)
    echo "check $name: FAILED (exit $rc, ${seconds} s; log $log): $(echo "$detail" | cut -c1-200)"
    failed=$((failed + 1))
  fi
  grep -o 'measured: .*' "$log" | cut -c1-300 | sed 's/^/    /'
done
echo "gpu_check: $passed passed, $failed failed, $unavailable not available"
[ $failed -eq 0 ]
