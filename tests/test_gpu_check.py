"""scripts/gpu_check.sh, the one call a GPU machine gets, run here on the CPU (``--smoke``: the
CUDA C through the CPU harness, Numba CUDA in its simulator) with a fake nvidia-smi: every step
in its own process under its own limit, the versions first, each step's status in the results
the moment it ends, a budget the whole run never passes, and the early stops."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = ["versions", "nvidia-smi", "preflight", "pytest_gpu", "device", "attention", "other_kernels",
         "block_copies", "models", "end_to_end", "parallel", "warm_cpu"]


def run_gpu_check_sh(tmp_path, *args, env_extra=None, fake_smi=True):
    """scripts/gpu_check.sh as a GPU machine runs it, with a fake nvidia-smi first on PATH."""
    out = tmp_path / "out"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if fake_smi:
        smi = bin_dir / "nvidia-smi"
        smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI 580.00  (fake, for the test)'\n")
        smi.chmod(0o755)
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable,
           "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", **(env_extra or {})}
    started = time.monotonic()
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), *args], capture_output=True,
                          text=True, timeout=900, env=env, cwd=tmp_path)
    return done, out, time.monotonic() - started


def test_the_gpu_check_script_runs_every_step_on_the_cpu_harness(tmp_path):
    """--smoke: the versions, the preflight, the GPU tests (they skip), every step of the GPU check
    and the CPU warm-up beside them; every step runs, passes, logs, and is in the results."""
    done, out, _ = run_gpu_check_sh(tmp_path, "--smoke")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert not (out / "FAILED").exists()
    report = json.loads((out / "gpu_results.json").read_text())
    assert "errors" not in report, report.get("errors")
    assert sorted(report["steps"]) == sorted(STEPS)
    assert all(step["exit"] == 0 and not step["timed_out"] for step in report["steps"].values()), report["steps"]
    for step in STEPS:
        assert (out / f"{step}.txt").exists(), step
    versions = report["versions"]                   # first, and from metadata: nothing imported to learn them
    assert versions["numpy"] and versions["numba"] and versions["python"] and "cupy-cuda13x" in versions
    assert "fake, for the test" in (out / "nvidia-smi.txt").read_text()
    assert "preflight: ok" in (out / "preflight.txt").read_text()
    assert "PASSED" in (out / "pytest_gpu.txt").read_text() or "SKIPPED" in (out / "pytest_gpu.txt").read_text()
    # every kernel variant within one rounding of its spec (gpu_kernel_checks.ROUNDING), none skipped
    attention, other, models = report["attention"], report["other_kernels"], report["models"]
    assert all(row["within_tolerance"] and row["max_abs_error"] < 2e-2 for row in attention)
    assert any(row["partitions"] > 1 for row in attention)                      # split-K exercised
    assert any(row.get("window") and row["partitions"] > 1 for row in attention)   # ... with a window
    assert {row["dtype"] for row in attention} == {"float32", "float16", "bfloat16"}
    assert all(row.get("bit_exact", True) and row.get("within_tolerance", True) for row in other)
    assert {"rms_norm", "silu_and_mul", "rotary", "write_kv", "update_key_bounds"} <= {
        row["kernel"] for row in other if row.get("dtype") == "bfloat16"}
    assert report["block_copies"] and all(row["bit_exact"] for row in report["block_copies"])
    assert len(models) == 3 and all(row["within_tolerance"] for row in models)
    assert not any("skipped" in row for row in attention + other + models)
    assert report["end_to_end"]["minipaged"]["generated_tokens"] > 0
    # the peer ran, or its failure was recorded without costing minipaged's own numbers
    peer = report["end_to_end"]["hf_transformers"]
    assert "generation_tok_s" in peer or "error" in peer
    assert report["greedy_vs_cpu_float32"]["tokens_agreeing_before_first_divergence"] > 0
    split = report["parallel"]["uni_tp3_pp2"]         # shards against one worker, same device
    assert split["same_tokens"] and split["max_logit_diff"] < 1e-4
    assert report["parallel"]["nccl_over_ray"].startswith("skipped")


def test_a_spent_budget_cuts_the_run_short_and_keeps_what_it_measured(tmp_path):
    """A budget too small for every step: the run ends within it; the steps that ran are in the
    results with their status, the ones cut or not started are recorded as timed out, and FAILED
    names them."""
    budget = 16
    done, out, seconds = run_gpu_check_sh(tmp_path, "--smoke", env_extra={"GPU_CHECK_BUDGET": str(budget)})
    assert done.returncode == 1
    assert seconds < budget + 10                      # the budget, the last step's kill grace, start-up
    report = json.loads((out / "gpu_results.json").read_text())
    steps = report["steps"]
    assert steps["versions"]["exit"] == 0 and steps["preflight"]["exit"] == 0
    cut = [name for name, step in steps.items() if step["timed_out"]]
    assert "parallel" in cut, steps                   # the last step never had its time
    assert all(name in (out / "FAILED").read_text() for name in cut if name != "warm_cpu")
    assert "the 16 s budget is spent" in (out / "parallel.txt").read_text()


def test_the_gpu_check_script_stops_at_kernels_that_do_not_compile(tmp_path):
    """No device visible: the CUDA C cannot load, so the script stops after the preflight, saying
    why in $OUT/FAILED; the versions came first and are kept."""
    done, out, _ = run_gpu_check_sh(tmp_path, env_extra={"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 1
    failed = (out / "FAILED").read_text()
    assert "preflight" in failed and "preflight.txt" in failed
    preflight = (out / "preflight.txt").read_text()
    assert "PREFLIGHT FAILED: the CUDA C kernels" in preflight
    assert not (out / "pytest_gpu.txt").exists()
    report = json.loads((out / "gpu_results.json").read_text())
    assert report["versions"]["numpy"] and set(report["steps"]) >= {"versions", "nvidia-smi", "preflight"}


def test_the_gpu_check_script_stops_without_a_driver(tmp_path):
    if Path("/usr/bin/nvidia-smi").exists():
        pytest.skip("this machine has a real nvidia-smi")
    done, out, _ = run_gpu_check_sh(tmp_path, env_extra={"PATH": "/usr/bin:/bin"}, fake_smi=False)
    assert done.returncode == 1
    assert "no nvidia-smi" in (out / "FAILED").read_text()
    assert not (out / "preflight.txt").exists()


def test_the_gpu_check_module_keeps_its_documented_name():
    done = subprocess.run([sys.executable, "-m", "minipaged.gpu_check", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "--smoke" in done.stdout and "--preflight" in done.stdout
    assert "--section" in done.stdout
