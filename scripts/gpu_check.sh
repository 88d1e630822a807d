#!/usr/bin/env bash
# Everything that needs a GPU, in one call of under ten minutes on a machine with no network:
# the GPU tests, every CUDA kernel checked against its NumPy spec and timed, and the
# end-to-end benchmark against Hugging Face transformers. Results land in $OUT (default
# ./gpu-out): gpu_results.json, pytest_gpu.txt. Record them in docs/gpu.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
# numpy, numba(-cuda), cupy, safetensors, tokenizers, jinja2, tqdm, torch, transformers are
# expected there already; install minipaged itself without touching the network
$PY -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
$PY -c "import cupy; print('GPU:', cupy.cuda.runtime.getDeviceProperties(0)['name'].decode())"
timeout 240 $PY -m pytest -q -m gpu tests/test_cuda_kernels.py 2>&1 | tee "$OUT/pytest_gpu.txt"
timeout 420 $PY -m minipaged.gpu_check --out "$OUT" 2>&1 | tail -80
