#!/usr/bin/env bash
# Every GPU check in one call, for a lent machine with an NVIDIA GPU whose python3 has jax
# with a CUDA plugin but may lack lark and maskc (a machine that cannot reach a package
# registry: put lark's wheel in .whl/ first). Runs, each under its own time limit so
# one that hangs leaves the others' output:
#   1. `make test-gpu`'s tests (tests/test_gpu.py): the Triton-compiled kernels against
#      float64 NumPy and the dense reference, and the traced lowering on the device;
#   2. benchmarks/traced_lowering.py with the traced path compiled for the GPU;
#   3. benchmarks/gpu_attention.py at 8K and 32K, flash against cuDNN.
# Logs go to $OUT (or /tmp/gpu_check); the last lines are a summary. TEST_S, TRACED_S and
# ATTENTION_S are each step's limit in seconds; 0 skips the step.
#
#   bash benchmarks/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
PY=${GPU_PYTHON:-python3}
case $PY in /*) ;; */*) PY=$PWD/$PY ;; esac
SITE=/tmp/maskc_site
if [ -d .whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" .whl/*.whl
fi
$PY -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target "$SITE" . \
  2>/dev/null || { echo "cannot install maskc"; exit 1; }
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=ci
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
(cd /tmp && $PY -c "import jax, maskc; print('jax', jax.__version__, jax.devices())") \
  | tee -a "$OUT/gpu.txt"

# Run from tests/ (its conftest and reference module), importing the installed maskc.
touch "$OUT/test_gpu.log" "$OUT/traced_lowering.log"
if [ "${TEST_S:-300}" != 0 ]; then
  (cd tests && MASKC_TEST_GPU=1 timeout "${TEST_S:-300}" $PY -m pytest -q -p no:cacheprovider \
    -m gpu --rootdir=. -c /dev/null -o 'markers=gpu' test_gpu.py 2>&1) | tee "$OUT/test_gpu.log"
fi
if [ "${TRACED_S:-150}" != 0 ]; then
  timeout "${TRACED_S:-150}" $PY benchmarks/traced_lowering.py --repeat 5 2>&1 \
    | tee "$OUT/traced_lowering.log"
fi
if [ "${ATTENTION_S:-200}" != 0 ]; then
  timeout "${ATTENTION_S:-200}" $PY benchmarks/gpu_attention.py --lengths 8192 32768 \
    --impls flash cudnn --repeats 3 2>&1 | tee "$OUT/gpu_attention.log"
fi

echo "== summary"
cat "$OUT/gpu.txt"
grep -E "(passed|failed|error|skipped) in" "$OUT/test_gpu.log"
grep '^|' "$OUT/traced_lowering.log"
