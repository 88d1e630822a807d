#!/usr/bin/env bash
# Everything that needs a GPU, in one call of under ten minutes on a machine with no network:
# the GPU tests, every CUDA kernel checked against its NumPy spec and timed, and the
# end-to-end benchmark against Hugging Face transformers. Results land in $OUT (default
# ./gpu-out): gpu_results.json (written after every step), pytest_gpu.txt. Record them in
# docs/gpu.md. Needs there: numpy, numba with CUDA, cupy, safetensors, tokenizers, jinja2,
# tqdm, torch, transformers, pytest (no pip install: nothing can be fetched).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PY=${PYTHON:-python3}
# minipaged.model and minipaged.kernels are the top-level model/ and kernels/ folders
# (installed by pip's package-dir mapping); without installing, links do the same.
[ -e minipaged/kernels ] || ln -s ../kernels minipaged/kernels
[ -e minipaged/model ] || ln -s ../model minipaged/model
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
$PY -c "import minipaged.kernels.cuda, minipaged.model.llama" || { echo "minipaged does not import"; exit 1; }
# cuda_fp16.h must be found by NVRTC (CuPy no longer ships it): fail early and say where we looked
$PY - <<'PYEOF' 2>&1 | tee "$OUT/preflight.txt"
import cupy
from minipaged.kernels.cuda import cuda_include_dirs
print("GPU:", cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), "| CuPy", cupy.__version__,
      "| include dirs:", cuda_include_dirs())
cupy.RawModule(code='#include <cuda_fp16.h>\nextern "C" __global__ void k(__half* x) { x[0] = __float2half(1.f); }',
               options=tuple(f"-I{d}" for d in cuda_include_dirs())).get_function("k")
print("fp16 compile: ok")
PYEOF
timeout 100 $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$OUT/pytest_gpu.txt"
timeout 420 $PY -m minipaged.tools.gpu_check --out "$OUT" 2>&1 | tail -60
