#!/usr/bin/env bash
# The wheels bench/gpu_check.sh installs on a GPU machine that reaches no package registry
# (one H200: Python 3.12 with torch 2.11, transformers, safetensors, pytest, ... but no
# megatron-core). Run it where pip reaches the registry:
#   bash bench/gpu_wheels.sh [DIR]        (default .gpu-wheels/, ignored by git)
# Downloads each pinned wheel for CPython 3.12, manylinux x86_64, without dependencies (the
# checks import none that the machine lacks: each wheel's own are printed for review), replaces
# what DIR held (two versions of a package stop the install), prints every wheel's size, and
# fails when they take more than 64 MiB, what a device call carries beside the checkout.
# Transformer Engine and SGLang are not among them: far over that size (their GPU checks say
# "not available" there).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-${GPU_CHECK_WHEELS:-.gpu-wheels}}"
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
WHEELS=(
  "megatron-core==0.16.1"  # the version .venv runs; its only compiled part (datasets' helpers) is unused here
)
LIMIT_BYTES=$((64 * 1024 * 1024))

fresh=$(mktemp -d -t gpu_wheels.XXXXXX)
trap 'rm -rf "$fresh"' EXIT
platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  platforms+=(--platform "${tag}_x86_64")
done
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d "$fresh" "${WHEELS[@]}"
mkdir -p "$DIR"
rm -f "$DIR"/*.whl
mv "$fresh"/*.whl "$DIR"/

total=0
for wheel in "$DIR"/*.whl; do
  bytes=$(stat -c %s "$wheel")
  total=$((total + bytes))
  requires=$(unzip -p "$wheel" '*.dist-info/METADATA' | grep '^Requires-Dist:' | grep -v 'extra ==' \
             | sed 's/^Requires-Dist: //' | paste -sd ';' | sed 's/;/; /g')
  printf '%8.2f MiB  %s  (requires: %s)\n' "$(echo "$bytes / 1048576" | bc -l)" "$(basename "$wheel")" "${requires:-nothing}"
done
printf '%8.2f MiB  in all, in %s/\n' "$(echo "$total / 1048576" | bc -l)" "$DIR"
if [ "$total" -gt "$LIMIT_BYTES" ]; then
  echo "gpu_wheels: over the 64 MiB a device call carries" >&2
  exit 1
fi
