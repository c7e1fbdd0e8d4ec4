#!/usr/bin/env bash
# Every GPU check in one call, for a lent machine with an NVIDIA GPU whose python3 has jax
# with a CUDA plugin but may lack lark and maskc (a machine that cannot reach a package
# registry: put lark's wheel in .whl/ first). Runs, each under its own time limit so
# one that hangs leaves the others' output:
#   1. `make test-gpu`'s tests (tests/test_gpu.py): the Triton-compiled kernels against
#      float64 NumPy and the dense reference, and the traced lowering on the device;
#   2. benchmarks/traced_lowering.py with the traced path compiled for the GPU;
#   3. benchmarks/gpu_attention.py at 8K and 32K (or $LENGTHS): flash, jax's cuDNN, and
#      maskc's cudnn, tokamax (tokamax's forward, flash's backward) and auto engines,
#      forward and forward+backward, then the cost model's rates as measured
#      (each engine's GPU_COST, maskc.kernels.api.gpu_costs());
#   4. the same at 128K for causal and packed documents, forward only;
#   5. backend="mosaic_gpu" (the Pallas Mosaic GPU forward, and its opt-in Mosaic GPU
#      backward, `maskc.kernels.mosaic_gpu.forward.BACKWARD = "mosaic_gpu"`; neither run on a GPU before):
#      a. a smoke run, one small causal call against the dense reference (SMOKE_S, 45 s: a
#         kernel that deadlocks on its barriers hangs here, not in the tests);
#      b. the same for the Mosaic GPU backward: one small causal gradient against the
#         dense reference's (BWD_SMOKE_S, 45 s);
#      c. the forward's tests in tests/test_gpu.py (`-k "mosaic and not backward"`, with
#         flash's backward; MOSAIC_S, 150 s), which step 1 leaves out;
#      d. the Mosaic GPU backward's tests (`-k mosaic_backward`, gradients against float64;
#         MOSAIC_BWD_S, 150 s), verbose so that a run cut by its limit still says which
#         passed;
#      e. its columns beside maskc's cudnn in benchmarks/gpu_attention.py at
#         ${MOSAIC_LENGTHS:-32768}, forward and forward+backward, with
#         `sliding(4096) | sink(4)`: `mosaic` (flash's backward) and `mg-bwd` (its own),
#         and the backward's TFLOP/s (MOSAIC_BENCH_S, 90 s).
#      Step 5 alone stays within 8 minutes (its limits add up to 480 s).
#   6. benchmarks/flax_decode.py at 8K and 32K cached tokens: maskc.flax's decode step
#      with flash-decoding as the heuristic picks it and off (`--splits auto off`), against
#      dense-mask attention, for the Gemma 3 and Llama 4 configs (DECODE_S, 150 s; needs
#      flax, which .whl/tokamax/ holds).
# tokamax (optional) comes from .whl/tokamax/: its wheel and the dependencies its attention
# imports, each installed with --no-deps so that pip never touches the machine's jax.
# Logs go to $OUT (or /tmp/gpu_check); the last lines are a summary. TEST_S, TRACED_S,
# ATTENTION_S and LONG_S are each step's limit in seconds; 0 skips the step. To trim a run:
# GPU_TESTS is a pytest `-k` expression selecting step 1's tests (e.g. `tokamax`), and
# LENGTHS the lengths of step 3 (e.g. `32768`).
#
#   bash benchmarks/gpu_check.sh
#   GPU_TESTS=tokamax LENGTHS=32768 bash benchmarks/gpu_check.sh      # about 5 minutes
#   TEST_S=0 ATTENTION_S=0 LONG_S=0 DECODE_S=0 bash benchmarks/gpu_check.sh   # mosaic_gpu only
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
if [ -d .whl/tokamax ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" \
    .whl/tokamax/*.whl || echo "cannot install tokamax's wheels"
fi
$PY -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target "$SITE" . \
  2>/dev/null || { echo "cannot install maskc"; exit 1; }
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=ci
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
(cd /tmp && $PY -c "import jax, maskc; print('jax', jax.__version__, jax.devices())") \
  | tee -a "$OUT/gpu.txt"
(cd /tmp && timeout 120 $PY -c "
from tokamax._src.ops.attention import pallas_mosaic_gpu; import tokamax
print('tokamax', tokamax.__version__)" 2>&1 | tail -1) | tee -a "$OUT/gpu.txt"

# Run from tests/ (its conftest and reference module), importing the installed maskc.
touch "$OUT/test_gpu.log" "$OUT/traced_lowering.log" "$OUT/gpu_attention.log" \
  "$OUT/gpu_attention_long.log" "$OUT/mosaic_smoke.log" "$OUT/test_mosaic_gpu.log" \
  "$OUT/mosaic_bwd_smoke.log" "$OUT/test_mosaic_backward.log" \
  "$OUT/gpu_attention_mosaic.log" "$OUT/flax_decode.log"
SELECT="not mosaic${GPU_TESTS:+ and ($GPU_TESTS)}"
if [ "${TEST_S:-180}" != 0 ]; then
  (cd tests && MASKC_TEST_GPU=1 timeout "${TEST_S:-180}" $PY -m pytest -q -p no:cacheprovider \
    -m gpu --rootdir=. -c /dev/null -o 'markers=gpu' -k "$SELECT" test_gpu.py \
    2>&1) | tee "$OUT/test_gpu.log"
fi
if [ "${TRACED_S:-0}" != 0 ]; then
  timeout "${TRACED_S}" $PY benchmarks/traced_lowering.py --repeat 5 2>&1 \
    | tee "$OUT/traced_lowering.log"
fi
if [ "${ATTENTION_S:-240}" != 0 ]; then
  timeout "${ATTENTION_S:-240}" $PY benchmarks/gpu_attention.py --lengths ${LENGTHS:-8192 32768} \
    --impls flash cudnn be-cudnn tokamax auto --repeats 3 2>&1 | tee "$OUT/gpu_attention.log"
fi
if [ "${LONG_S:-60}" != 0 ]; then
  timeout "${LONG_S:-60}" $PY benchmarks/gpu_attention.py --lengths 131072 --modes fwd \
    --masks causal documents --impls flash be-cudnn tokamax auto --repeats 2 2>&1 \
    | tee "$OUT/gpu_attention_long.log"
fi

if [ "${SMOKE_S:-45}" != 0 ]; then
  (cd /tmp && timeout "${SMOKE_S:-45}" $PY -c "
import jax, jax.numpy as jnp, numpy as np, maskc
from maskc.kernels import api
try:  # JAX's attention_mgpu.py refuses causal masks on CUDA 12.8.0-12.9.0 (a ptxas bug)
  from jax._src.lib import cuda_versions
  print('CUDA runtime', cuda_versions.cuda_runtime_get_version())
except Exception as e:
  print('CUDA runtime unknown:', e)
bm = maskc.compile('causal', 512, block_q=128, block_kv=128)
x = [jax.random.normal(jax.random.key(i), (1, 512, 2, 128), jnp.bfloat16) for i in range(3)]
out = jax.jit(lambda q, k, v: api.attention(q, k, v, bm, backend='mosaic_gpu'))(*x)
ref = api.attention(*x, bm, backend='dense')
err = float(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32)).max())
print('mosaic_gpu smoke: ran, max abs error vs dense', err, 'OK' if err < 5e-2 else 'WRONG')
" 2>&1 | tail -30) | tee "$OUT/mosaic_smoke.log"
fi
if [ "${BWD_SMOKE_S:-45}" != 0 ]; then
  (cd /tmp && timeout "${BWD_SMOKE_S:-45}" $PY -c "
import jax, jax.numpy as jnp, maskc
from maskc.kernels import api
from maskc.kernels.mosaic_gpu import forward as mosaic_gpu
mosaic_gpu.BACKWARD = 'mosaic_gpu'
bm = maskc.compile('causal', 512, block_q=128, block_kv=128)
x = [jax.random.normal(jax.random.key(i), (1, 512, 2, 128), jnp.bfloat16) for i in range(3)]
def grads(backend):
  loss = lambda q, k, v: api.attention(q, k, v, bm, backend=backend).astype(jnp.float32).sum()
  return jax.jit(jax.grad(loss, (0, 1, 2)))(*x)
ref = grads('dense')
for n, g, r in zip('qkv', grads('mosaic_gpu'), ref):
  err = float(jnp.abs(g.astype(jnp.float32) - r.astype(jnp.float32)).max())
  print(f'mosaic_gpu backward smoke: d{n} max abs error vs dense', err,
        'OK' if err < 5e-2 else 'WRONG')
" 2>&1 | tail -30) | tee "$OUT/mosaic_bwd_smoke.log"
fi
if [ "${MOSAIC_S:-150}" != 0 ]; then
  (cd tests && MASKC_TEST_GPU=1 timeout "${MOSAIC_S:-150}" $PY -m pytest -q -p no:cacheprovider \
    -m gpu --rootdir=. -c /dev/null -o 'markers=gpu' -k "mosaic and not backward" test_gpu.py \
    2>&1) | tee "$OUT/test_mosaic_gpu.log"
fi
if [ "${MOSAIC_BWD_S:-150}" != 0 ]; then
  (cd tests && MASKC_TEST_GPU=1 timeout "${MOSAIC_BWD_S:-150}" $PY -m pytest -v -p no:cacheprovider \
    -m gpu --rootdir=. -c /dev/null -o 'markers=gpu' -k mosaic_backward test_gpu.py \
    2>&1) | tee "$OUT/test_mosaic_backward.log"
fi
if [ "${MOSAIC_BENCH_S:-90}" != 0 ]; then
  timeout "${MOSAIC_BENCH_S:-90}" $PY benchmarks/gpu_attention.py \
    --lengths ${MOSAIC_LENGTHS:-32768} --modes fwd fwd+bwd --masks causal documents sliding-sink \
    --impls be-cudnn mosaic_gpu mosaic_gpu-bwd --repeats 3 2>&1 \
    | tee "$OUT/gpu_attention_mosaic.log"
fi
if [ "${DECODE_S:-150}" != 0 ]; then
  timeout "${DECODE_S:-150}" $PY benchmarks/flax_decode.py --lengths 8192 32768 \
    --configs gemma3 llama4 --splits auto off 2>&1 \
    | tee "$OUT/flax_decode.log"
fi

echo "== summary"
cat "$OUT/gpu.txt"
grep -E "(passed|failed|error|skipped) in" "$OUT/test_gpu.log"
grep '^|' "$OUT/traced_lowering.log"
grep -A4 "GPU_COSTS as measured" "$OUT/gpu_attention.log"
grep -E "mosaic_gpu smoke|CUDA runtime" "$OUT/mosaic_smoke.log"
grep -E "(passed|failed|error|skipped) in" "$OUT/test_mosaic_gpu.log"
grep -E "mosaic_gpu backward smoke" "$OUT/mosaic_bwd_smoke.log"
echo "mosaic backward tests passed: $(grep -c ' PASSED' "$OUT/test_mosaic_backward.log")"
grep -E "(passed|failed|error|skipped) in|FAILED" "$OUT/test_mosaic_backward.log"
grep -E "^fwd|mosaic_gpu" "$OUT/gpu_attention_mosaic.log"
grep '^|' "$OUT/flax_decode.log"
