#!/usr/bin/env bash
# Everything that needs a GPU, in one call of at most 9 minutes (GPU_CHECK_BUDGET, 540 s), worst
# case, on a machine with no network. Every step runs in its own process under its own time limit
# (shortened, when the budget has less left, so the whole run never passes it), logs to
# $OUT/<step>.txt as it goes, and has its exit status and seconds recorded in
# $OUT/gpu_results.json the moment it ends, so a run killed from outside still returns all it
# measured. In order:
#   versions     what the machine has (Python, the libraries, CUDA, this commit): first, so a
#                failure below can be read against it ($OUT/versions.txt and the JSON)
#   nvidia-smi   the driver; none: stop
#   warm_cpu     the CPU kernels compiled (Numba's cache) in the background, beside the preflight
#                and the GPU tests, which compare the GPU against the CPU engine
#   preflight    the CUDA C modules compiled by the engine's loader, a Numba CUDA kernel launched
#                on a mapped host array; the CUDA C failing: stop (Numba CUDA failing only costs
#                the block copies, and is reported)
#   pytest       tests/test_gpu.py, verbose (each test's name is in the log before it runs)
#   the GPU check (python -m minipaged.tools.gpu_check --section ...): device and copy bandwidth,
#                attention kernels, other kernels, block copies, whole models, end to end against
#                Hugging Face transformers, tensor / pipeline parallelism
# Results: $OUT (default ./gpu-out): the logs, gpu_results.json, FAILED when something failed.
# Record them in docs/gpu.md. Needs there: numpy, numba and numba-cuda, cupy, safetensors,
# tokenizers, jinja2, tqdm, torch, transformers, pytest (nothing is installed: no network).
#
#   scripts/gpu_check.sh           on a GPU machine
#   scripts/gpu_check.sh --smoke   the same steps on a CPU (tests/test_gpu_check.py): the CUDA C
#                                  through the CPU harness, Numba CUDA in its simulator
set -uo pipefail
cd "$(dirname "$0")/.."
SMOKE=()
[ "${1:-}" = "--smoke" ] && SMOKE=(--smoke)
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
rm -f "$OUT/FAILED" "$OUT/gpu_results.json"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PY=${PYTHON:-python3}
# The smoke run's kernels go through the CPU harness (an OS thread per CUDA thread): its steps
# get twice the time (the control flow is what it tests)
SCALE=1
[ ${#SMOKE[@]} -gt 0 ] && SCALE=2
BUDGET=${GPU_CHECK_BUDGET:-$((540 * SCALE))}
GRACE=5                       # seconds a killed step gets between TERM and KILL
START=$SECONDS
failed=()

fail() {  # stop here: say why on stderr and in $OUT/FAILED
    echo "gpu_check FAILED: $*" | tee -a "$OUT/FAILED" >&2
    exit 1
}

RESULTS=$OUT                  # the folder of the gpu_results.json that step records go to
record() {  # record NAME EXIT SECONDS in the results (best effort: the step may have broken Python)
    $PY -m minipaged.tools.gpu_check --out "$RESULTS" --record "$1" "$2" "$3" >/dev/null 2>&1 || true
}

# step NAME LIMIT CMD...: CMD under LIMIT seconds, or what the budget has left, if less; its
# output in $OUT/NAME.txt; returns its exit status (124: timed out)
step() {
    local name=$1 limit=$(($2 * SCALE))
    shift 2
    local left=$((BUDGET - (SECONDS - START) - GRACE))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -le 0 ]; then
        echo "[gpu_check] $name: not run, the ${BUDGET} s budget is spent" | tee "$OUT/$name.txt"
        record "$name" 124 0
        return 124
    fi
    local began=$SECONDS status
    echo "[gpu_check] $name (at most $limit s) ..."
    timeout -k "$GRACE" "$limit" "$@" > "$OUT/$name.txt" 2>&1
    status=$?
    echo "[gpu_check] $name: exit $status after $((SECONDS - began)) s"
    record "$name" "$status" "$((SECONDS - began))"
    return $status
}

# Where minipaged is not installed, it is put on the path through a folder that holds nothing
# but a link to it: the checkout's root would put its top-level kernels/ and model/ on the path
# of every child too, and transformers imports Hugging Face's `kernels` package by that name.
if ! (cd / && $PY -c "import minipaged.kernels.cuda, minipaged.model.llama") 2>/dev/null; then
    [ -e minipaged/kernels ] || ln -s ../kernels minipaged/kernels
    [ -e minipaged/model ] || ln -s ../model minipaged/model
    mkdir -p "$OUT/pythonpath"
    ln -sfn "$PWD/minipaged" "$OUT/pythonpath/minipaged"
    export PYTHONPATH="$OUT/pythonpath${PYTHONPATH:+:$PYTHONPATH}"
    (cd / && $PY -c "import minipaged.kernels.cuda, minipaged.model.llama") || fail "minipaged does not import"
fi

step versions 20 $PY -m minipaged.tools.gpu_check --out "$OUT" --section versions || failed+=("versions")

# The driver: without it nothing below can work.
command -v nvidia-smi >/dev/null || fail "no nvidia-smi on PATH: no NVIDIA driver on this machine"
step nvidia-smi 10 nvidia-smi || fail "nvidia-smi failed (see $OUT/nvidia-smi.txt)"
# numba-cuda finds libNVVM and libdevice through CUDA_HOME when CUDA comes from a toolkit
# rather than from pip wheels.
if [ -z "${CUDA_HOME:-}" ] && [ -d /usr/local/cuda ]; then
    export CUDA_HOME=/usr/local/cuda
fi
echo "CUDA_HOME=${CUDA_HOME:-(unset)}" >> "$OUT/nvidia-smi.txt"

# The CPU kernels, beside the preflight and the GPU tests (its own process, its own limit).
# Its results go to a folder of their own (two processes never write one JSON at once).
(RESULTS="$OUT.warm"; step warm_cpu 150 $PY -m minipaged.tools.gpu_check "${SMOKE[@]}" --out "$OUT.warm" \
    --section warm_cpu) > /dev/null &
warm=$!

# Preflight: the real kernels through the engine's loader, and Numba CUDA.
step preflight 80 $PY -m minipaged.tools.gpu_check --preflight "${SMOKE[@]}"
status=$?
cat "$OUT/preflight.txt"
if grep -q "PREFLIGHT FAILED: the CUDA C kernels" "$OUT/preflight.txt" || ! grep -q "^preflight:" "$OUT/preflight.txt"; then
    kill "$warm" 2>/dev/null
    fail "preflight (exit $status): the CUDA kernels do not compile or the preflight did not finish; see $OUT/preflight.txt"
fi
[ $status -eq 0 ] || failed+=("preflight: Numba CUDA (block copies) does not launch, see $OUT/preflight.txt")

# The checks. Each runs even if the one before failed; the script's status says whether all passed.
step pytest_gpu 110 $PY -m pytest -v -rA -m gpu -p no:cacheprovider --durations=0 tests/test_gpu.py
status=$?
tail -20 "$OUT/pytest_gpu.txt"
[ $status -eq 0 ] || failed+=("GPU tests (exit $status, see $OUT/pytest_gpu.txt)")
for spec in device:25 attention:70 other_kernels:25 block_copies:20 models:45 end_to_end:100 parallel:40; do
    name=${spec%%:*}
    step "$name" "${spec##*:}" $PY -m minipaged.tools.gpu_check "${SMOKE[@]}" --out "$OUT" --section "$name"
    status=$?
    tail -5 "$OUT/$name.txt"
    [ $status -eq 0 ] || failed+=("$name (exit $status, see $OUT/$name.txt and the errors in $OUT/gpu_results.json)")
done

# The warm-up's step record joins the results.
wait "$warm" 2>/dev/null
status=$?
[ $status -eq 0 ] || failed+=("warm_cpu (exit $status, see $OUT/warm_cpu.txt)")
record warm_cpu "$status" "$($PY -c "import json,sys; print(json.load(open(sys.argv[1]))['steps']['warm_cpu']['seconds'])" \
    "$OUT.warm/gpu_results.json" 2>/dev/null || echo 0)"
rm -rf "$OUT.warm"
echo "[gpu_check] done in $((SECONDS - START)) s (budget $BUDGET s)"
[ ${#failed[@]} -eq 0 ] || fail "${failed[*]}"
echo "gpu_check: all passed; results in $OUT"
