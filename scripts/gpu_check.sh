#!/usr/bin/env bash
# Everything that needs a GPU, in one call of under ten minutes on a machine with no network:
#   0. nvidia-smi, then a preflight: the four real CUDA modules compiled by the engine's own
#      loader (kernels.cuda.gpu_ops) and a one-line Numba CUDA kernel launched on a mapped
#      array. If either fails, the script stops at once, says why in $OUT/FAILED, and runs
#      nothing else;
#   1. the GPU tests (tests/test_gpu.py);
#   2. every CUDA kernel checked against its NumPy spec and timed, and the end-to-end
#      benchmark against Hugging Face transformers (python -m minipaged.tools.gpu_check).
# Results land in $OUT (default ./gpu-out): nvidia-smi.txt, preflight.txt, pytest_gpu.txt,
# gpu_results.json (written after every step), and FAILED when something failed. Record them
# in docs/gpu.md. Needs there: numpy, numba with CUDA, cupy, safetensors, tokenizers, jinja2,
# tqdm, torch, transformers, pytest (no pip install: nothing can be fetched).
#
#   scripts/gpu_check.sh           on a GPU machine
#   scripts/gpu_check.sh --smoke   the same control flow on a CPU (tests/test_cuda_kernels.py):
#                                  the CUDA C through the CPU harness, Numba CUDA in its simulator
set -uo pipefail
cd "$(dirname "$0")/.."
SMOKE=()
[ "${1:-}" = "--smoke" ] && SMOKE=(--smoke)
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
rm -f "$OUT/FAILED"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PY=${PYTHON:-python3}

fail() {  # stop here: say why on stderr and in $OUT/FAILED
    echo "gpu_check FAILED: $*" | tee -a "$OUT/FAILED" >&2
    exit 1
}

# The driver first: without it nothing below can work.
command -v nvidia-smi >/dev/null || fail "no nvidia-smi on PATH: no NVIDIA driver on this machine"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || fail "nvidia-smi failed (see $OUT/nvidia-smi.txt)"
# numba-cuda finds libNVVM and libdevice through CUDA_HOME when CUDA comes from a toolkit
# rather than from pip wheels.
if [ -z "${CUDA_HOME:-}" ] && [ -d /usr/local/cuda ]; then
    export CUDA_HOME=/usr/local/cuda
fi
echo "CUDA_HOME=${CUDA_HOME:-(unset)}" >> "$OUT/nvidia-smi.txt"

# minipaged.model and minipaged.kernels are the top-level model/ and kernels/ folders
# (installed by pip's package-dir mapping); where minipaged is not installed, links do the same.
if ! $PY -c "import minipaged.kernels.cuda, minipaged.model.llama" 2>/dev/null; then
    [ -e minipaged/kernels ] || ln -s ../kernels minipaged/kernels
    [ -e minipaged/model ] || ln -s ../model minipaged/model
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    $PY -c "import minipaged.kernels.cuda, minipaged.model.llama" || fail "minipaged does not import"
fi

# Preflight: the real kernels through the engine's loader, and Numba CUDA, or stop.
$PY -m minipaged.tools.gpu_check --preflight "${SMOKE[@]}" > "$OUT/preflight.txt" 2>&1
status=$?
cat "$OUT/preflight.txt"
[ $status -eq 0 ] || fail "preflight (exit $status): the CUDA kernels do not compile or Numba CUDA does not launch; see $OUT/preflight.txt"

# The checks. Each runs even if the one before failed; the script's status says whether all passed.
failed=()
timeout 100 $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py > "$OUT/pytest_gpu.txt" 2>&1
status=$?
tail -20 "$OUT/pytest_gpu.txt"
[ $status -eq 0 ] || failed+=("GPU tests (exit $status, see $OUT/pytest_gpu.txt)")
timeout 420 $PY -m minipaged.tools.gpu_check "${SMOKE[@]}" --out "$OUT" > "$OUT/gpu_check.txt" 2>&1
status=$?
tail -60 "$OUT/gpu_check.txt"
[ $status -eq 0 ] || failed+=("gpu_check (exit $status, see $OUT/gpu_check.txt and the errors in $OUT/gpu_results.json)")
[ ${#failed[@]} -eq 0 ] || fail "${failed[*]}"
echo "gpu_check: all passed; results in $OUT"
