"""What runs before the GPU check's measurements (``scripts/gpu_check.sh``): a dump of what the
machine has (``versions``), a preflight that fails in seconds and says why if the CUDA C kernels
do not compile or Numba CUDA does not launch (``preflight``), and the CPU kernels compiled
beside the GPU steps that compare against them (``warm_cpu``). ``python -m
minipaged.tools.gpu_check --preflight`` and ``--section versions`` / ``warm_cpu`` run them."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path


def preflight(smoke: bool) -> int:
    """Fail in seconds, and say why, if the kernels cannot compile or Numba CUDA cannot launch."""
    failures = []
    try:
        from ..kernels.cuda import cuda_include_dirs, kernel_sources  # noqa: PLC0415

        if smoke:
            from ..kernels.cuda import cpu_harness_ops  # noqa: PLC0415

            ops = cpu_harness_ops()
        else:
            import cupy  # noqa: PLC0415

            from ..kernels.cuda import gpu_ops  # noqa: PLC0415

            props = cupy.cuda.runtime.getDeviceProperties(0)
            print(f"GPU: {props['name'].decode()} (sm_{props['major']}{props['minor']}), CuPy {cupy.__version__}, "
                  f"CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}, include dirs {cuda_include_dirs()}")
            ops = gpu_ops()      # the engine's own loader: every .cu file, the engine's flags
        print(f"compiled {', '.join(kernel_sources())}: {len(ops._kernels)} kernels")
    except Exception as err:  # noqa: BLE001 (reported, and the script stops)
        failures.append(f"the CUDA C kernels: {type(err).__name__}: {err}")
    try:
        if smoke:
            import numba  # noqa: PLC0415

            numba.config.ENABLE_CUDASIM = 1      # read when numba.cuda is first imported
        from ..kernels import block_copy  # noqa: PLC0415 (imports numba.cuda)

        if not block_copy.probe_mapped_launch():
            raise RuntimeError("the kernel ran but the mapped array does not hold its result")
        print(f"Numba CUDA: a kernel wrote a mapped host array ({'simulator' if smoke else 'device'}); "
              f"CUDA_HOME={os.environ.get('CUDA_HOME', '(unset)')}")
    except Exception as err:  # noqa: BLE001
        failures.append(f"Numba CUDA: {type(err).__name__}: {err} (on a toolkit install, is CUDA_HOME set?)")
    for failure in failures:
        print(f"PREFLIGHT FAILED: {failure}")
    print("preflight: ok" if not failures else "preflight: failed")
    return 1 if failures else 0


def versions() -> dict:
    """What the machine has, before anything runs: Python, the libraries (by their installed
    metadata, so a broken one cannot stop this), this checkout's commit, CUDA's versions."""
    out: dict = {"python": sys.version.split()[0], "platform": platform.platform(),
                 "cpu": platform.processor() or platform.machine()}
    for dist in VERSIONED:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    root = Path(__file__).resolve().parents[2]
    try:
        out["commit"] = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                                       text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        out["commit"] = None
    out["env"] = {k: os.environ[k] for k in ("CUDA_HOME", "CUDA_PATH", "CUDA_VISIBLE_DEVICES", "PYTHONPATH")
                  if k in os.environ}
    try:
        import cupy  # noqa: PLC0415

        out["cuda_driver"] = cupy.cuda.runtime.driverGetVersion()
        out["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
        out["nvrtc"] = ".".join(map(str, cupy.cuda.nvrtc.getVersion()))
    except Exception as err:  # noqa: BLE001 (no CuPy, no driver: said, not raised)
        out["cuda"] = f"{type(err).__name__}: {err}"
    return out


# the distributions whose versions the check records first
VERSIONED = ("minipaged", "numpy", "numba", "numba-cuda", "llvmlite", "cupy-cuda13x", "cupy-cuda12x", "cuda-bindings",
             "cuda-python", "ml_dtypes", "safetensors", "tokenizers", "jinja2", "torch", "transformers", "pytest", "ray")


def warm_cpu(smoke: bool) -> dict:
    """Compile the CPU kernels (or load them from Numba's cache) that the GPU tests and the greedy
    check compare against, before those need them: the CPU engine on a tiny random model with
    each KV format, block-sparse decode and n-gram speculation (smoke: the plain case only)."""
    from ..engine.llm import LLM  # noqa: PLC0415
    from ..model.random_llama import write_tiny_llama  # noqa: PLC0415
    from ..sampling_params import SamplingParams  # noqa: PLC0415

    shapes = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=300, max_position_embeddings=512)
    model_dir = write_tiny_llama(Path(tempfile.mkdtemp()) / "random-warm-up", seed=0, **shapes)
    configs = [{}] if smoke else [{}, dict(kv_cache_dtype="int8"), dict(kv_cache_dtype="fp8"),
                                  dict(sparse_attention_budget=32),
                                  dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3})]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False)
    for config in configs:
        llm = LLM(str(model_dir), device="cpu", cpu_gemm="numba", num_blocks=64, swap_space=0, **config)
        llm.generate([{"prompt_token_ids": list(range(3, 40))}], params, use_tqdm=False)
    return {"configurations": len(configs)}
