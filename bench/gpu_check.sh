#!/usr/bin/env bash
# The GPU path in one go, for a machine with one or more NVIDIA GPUs (H100/H200; about
# 10 minutes) and the project installed with the gpu extra (pip install -e ".[gpu]"):
#   bash bench/gpu_check.sh [PYTHON]
# One line per check (passed / failed / skipped, with pytest's reason), then
#   gpu_check: N passed, M failed
# Checks: Transformer Engine spec vs the local spec, FP8 forward/backward (two recipes),
# TP2 and TP2 + sequence parallelism over NCCL (2 GPUs or more), the weight checksum on
# GPU tensors, and an NCCL weight sync from the actor to a real SGLang server on the GPU
# with the served logprobs compared with the actor's after it.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${1:-${PYTHON:-.venv/bin/python}}"
LOG_DIR="${GPU_CHECK_LOG_DIR:-$(mktemp -d -t gpu_check.XXXXXX)}"

CHECKS=(
  "te_vs_local_spec=tests/gpu/test_transformer_engine.py::test_transformer_engine_matches_local_spec"
  "fp8_delayed=tests/gpu/test_transformer_engine.py::test_fp8_forward_backward[delayed]"
  "fp8_tensorwise=tests/gpu/test_transformer_engine.py::test_fp8_forward_backward[tensorwise]"
  "nccl_tp2=tests/gpu/test_transformer_engine.py::test_nccl_tensor_parallel"
  "nccl_tp2_sequence_parallel=tests/gpu/test_transformer_engine.py::test_nccl_sequence_parallel"
  "weight_checksum_gpu=tests/gpu/test_weight_sync_gpu.py::test_weight_checksum_reads_gpu_tensors"
  "sglang_nccl_weight_sync=tests/gpu/test_weight_sync_gpu.py::test_nccl_weight_sync_to_a_real_sglang_server"
)

"$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
  echo "gpu_check: no CUDA device visible to $PYTHON"; echo "gpu_check: 0 passed, 1 failed"; exit 1; }
"$PYTHON" -c "import torch; print('gpu_check: %d x %s, torch %s' % (torch.cuda.device_count(), torch.cuda.get_device_name(0), torch.__version__))"

passed=0; failed=0
for check in "${CHECKS[@]}"; do
  name="${check%%=*}"; node="${check#*=}"
  log="$LOG_DIR/$name.log"
  start=$(date +%s)
  "$PYTHON" -m pytest -q -rs -p no:cacheprovider "$node" > "$log" 2>&1
  rc=$?
  seconds=$(( $(date +%s) - start ))
  if [ $rc -eq 0 ] && grep -q " passed" "$log"; then
    echo "check $name: passed (${seconds} s)"; passed=$((passed + 1))
  elif [ $rc -eq 0 ] && grep -q "skipped" "$log"; then
    echo "check $name: skipped: $(grep -m1 -o 'SKIPPED.*' "$log" | cut -c1-160)"
  else
    echo "check $name: FAILED (${seconds} s; log $log): $(grep -m1 -E '^E ' "$log" | cut -c1-200)"
    failed=$((failed + 1))
  fi
done
echo "gpu_check: $passed passed, $failed failed"
[ $failed -eq 0 ]
