"""``python -m minipaged.gpu_check``: check and time every CUDA kernel, then the whole engine.

Run on a GPU machine by ``scripts/gpu_check.sh`` (one call, under ten minutes, no network).
``--preflight`` first, in seconds: the four CUDA C modules compiled by the engine's own
loader, and a one-line Numba CUDA kernel launched on a mapped (pinned) host array, as
swapping uses. Then:
  1. the device and its measured device-to-device copy bandwidth;
  2. every kernel variant against its NumPy spec on large random inputs (gpu_kernel_checks.py):
     float16 and bfloat16 activations, float, int8 and fp8 blocks, split-K, block-sparse decode,
     sliding windows (blocks before the window freed); bfloat16 rows are skipped, and say so,
     where CuPy has no bfloat16 (before CuPy 14);
  3. each kernel's time (CUDA events, median of many runs) and the bandwidth it reaches,
     as a share of the copy bandwidth (decode attention's goal: at least 60% at batch 64,
     context 2048, fp16 KV), over float16, int8 and fp8 blocks, and block-sparse decode
     against dense on an 8K context;
  3b. the forward pass through the kernels against the dense reference: a Llama in bfloat16,
     and a model with q/k/v/o biases, q/k norms and a sliding window, in float16 and bfloat16;
  4. the throughput benchmark end to end, minipaged against Hugging Face transformers (fp16),
     on a random model with SmolLM2-135M's shapes (the real weights cannot be fetched there),
     and greedy tokens of the GPU path against the CPU float32 path;
  5. tensor and pipeline parallelism: TP=3 x PP=2 with every worker on this GPU (``uni``)
     against one worker (tokens, the largest logit difference, seconds per step); the NCCL
     path needs at least 2 GPUs (tests/test_gpu.py runs it there), and is recorded as skipped
     on fewer.
``--smoke`` runs the same steps on the CPU (CUDA kernels through the CPU harness, tiny
shapes) so the script itself is tested in CI.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from .gpu_kernel_checks import block_copy_report, elementwise_report, kernel_report, model_report
from .gpu_preflight import preflight, versions, warm_cpu

SMOLLM2_SHAPES = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                      rope_theta=100000.0)


class Device:
    """The array module, the kernels and a timer, for the GPU or (smoke test) the CPU harness."""

    def __init__(self, smoke: bool) -> None:
        self.smoke = smoke
        if smoke:
            from ..kernels.cuda import cpu_harness_ops

            from ..kernels.cuda import BFLOAT16

            # split-K above 128 positions, not 1024: the smoke's short contexts split too
            self.xp, self.ops = np, cpu_harness_ops(split_k_above=128, partition_size=64)
            self.bfloat16 = BFLOAT16 is not None       # the harness needs only ml_dtypes
        else:
            import cupy

            from ..engine.backend import cupy_has_bfloat16
            from ..kernels.cuda import gpu_ops

            self.xp, self.ops = cupy, gpu_ops()
            self.bfloat16 = cupy_has_bfloat16()

    def asnumpy(self, a):
        return a if self.xp is np else self.xp.asnumpy(a)

    def time(self, fn, repeats: int) -> float:
        """Median seconds of ``fn()``: CUDA events on a GPU, perf_counter in the smoke test."""
        fn()
        samples = []
        for _ in range(repeats):
            if self.xp is np:
                t = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t)
            else:
                start, stop = self.xp.cuda.Event(), self.xp.cuda.Event()
                start.record()
                fn()
                stop.record()
                stop.synchronize()
                samples.append(self.xp.cuda.get_elapsed_time(start, stop) / 1e3)
        return float(np.median(samples))

    def info(self) -> dict:
        if self.xp is np:
            return {"device": "CPU harness (smoke test)", "machine": platform.processor()}
        props = self.xp.cuda.runtime.getDeviceProperties(0)
        return {"device": props["name"].decode(), "memory_gib": props["totalGlobalMem"] / 2**30,
                "compute_capability": f"{props['major']}.{props['minor']}",
                "multiprocessors": props["multiProcessorCount"], "cupy": self.xp.__version__,
                "cupy_bfloat16": self.bfloat16}


def copy_bandwidth(dev: Device, mib: int) -> float:
    """Bytes read + written per second by a device-to-device copy."""
    a = dev.xp.ones(mib * 2**20 // 4, dtype=np.float32)
    b = dev.xp.empty_like(a)
    seconds = dev.time(lambda: dev.xp.copyto(b, a), repeats=5 if dev.smoke else 20)
    return 2 * a.nbytes / seconds


def write_random_model(path: Path, shapes: dict) -> Path:
    """An HF Llama directory with these shapes and random weights, and a byte-level tokenizer."""
    from ..model.random_llama import write_tiny_llama

    return write_tiny_llama(path, seed=0, embed_scale=0.2, **{**shapes, "vocab_size": max(shapes["vocab_size"], 259)})


def end_to_end(dev: Device, smoke: bool, out: dict) -> None:
    from ..engine.backend import release_device_memory
    from ..engine.llm_engine import LLMEngine
    from ..engine.metrics import Metrics
    from ..sampling_params import SamplingParams
    from .bench_peers import run_peer
    from .measure import run_workload
    from .workloads import make_requests

    shapes = dict(SMOLLM2_SHAPES) if not smoke else dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                                          num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                                          vocab_size=300, max_position_embeddings=512)
    model_dir = write_random_model(Path(tempfile.mkdtemp()) / "random-smollm2-shapes", shapes)
    device = "cpu" if smoke else "cuda"
    cfg = dict(num_prompts=64 if not smoke else 4, min_prompt_len=32, max_prompt_len=256 if not smoke else 40,
               output_len=128 if not smoke else 4)
    requests = make_requests("throughput", cfg, shapes["vocab_size"], seed=0)
    out["end_to_end"] = {"model": "random weights, SmolLM2-135M shapes", "workload": cfg}
    try:  # the peer first, while the GPU's memory is all free (smoke: on the CPU, if torch is there)
        out["end_to_end"]["hf_transformers"] = run_peer(
            "hf", str(model_dir), [r.prompt for r in requests], cfg["output_len"], device=device,
            dtype="float32" if smoke else "float16")
    except Exception as err:  # noqa: BLE001 (a broken peer must not cost minipaged's own numbers)
        out["end_to_end"]["hf_transformers"] = {"error": f"{type(err).__name__}: {str(err)[-1500:]}"}
    # No swap space: this run never preempts, and its headline number must not depend on
    # Numba CUDA (the block copies), which has its own section above.
    # the CPU's linear layers through minipaged's own kernels: no oneMKL timing pass for a model
    # shape seen once (cpu_gemm="auto" would time both engines first); a GPU ignores it
    engine = LLMEngine(str(model_dir), device=device, dtype="float32" if smoke else "float16", cpu_gemm="numba",
                       kv_cache_space=1.0 if smoke else None, swap_space=0, log_stats_interval=0)
    run_workload(engine, make_requests("throughput", {**cfg, "num_prompts": 2, "output_len": 2}, shapes["vocab_size"], 1),
                 progress=False)
    engine.metrics = Metrics()
    result = run_workload(engine, requests, progress=False)
    out["end_to_end"].update(minipaged=result, kv_blocks_total=engine.block_manager.num_blocks)
    peer = out["end_to_end"].get("hf_transformers", {})
    if "generation_tok_s" in peer:
        out["end_to_end"]["speedup_vs_hf"] = result["generation_tok_s"] / peer["generation_tok_s"]
    del engine
    release_device_memory()     # the next engine sizes its pool from what this one leaves
    # greedy tokens of this device's path against the CPU float32 path, same random model
    prompts = [{"prompt_token_ids": r.prompt[:48]} for r in requests[:4]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2, detokenize=False)
    from ..engine.llm import LLM

    gpu = LLM(str(model_dir), device=device, dtype="float32", cpu_gemm="numba", num_blocks=1024, swap_space=0).generate(
        prompts, params, use_tqdm=False)
    cpu = LLM(str(model_dir), device="cpu", cpu_gemm="numba", kv_cache_space=0.5, swap_space=0).generate(
        prompts, params, use_tqdm=False)
    agree, near_ties = 0, 0
    for a, b in zip(gpu, cpu):
        for i, (x, y) in enumerate(zip(a.outputs[0].token_ids, b.outputs[0].token_ids)):
            if x != y:
                top = b.outputs[0].logprobs[i]
                margin = abs(top[y] - top.get(x, min(top.values())))
                near_ties += margin < 0.05
                break
            agree += 1
    out["greedy_vs_cpu_float32"] = {"tokens_agreeing_before_first_divergence": agree,
                                    "divergences_at_near_ties": near_ties}


def parallel_report(dev: Device, smoke: bool, out: dict) -> None:
    """Shards against one worker on the same device: tokens, logits, time per step."""
    from ..engine.backend import release_device_memory
    from ..engine.llm_engine import LLMEngine
    from ..sampling_params import SamplingParams

    shapes = dict(SMOLLM2_SHAPES, num_hidden_layers=4 if smoke else 30)
    if smoke:
        shapes.update(hidden_size=64, intermediate_size=96, vocab_size=300, max_position_embeddings=512)
    model_dir = write_random_model(Path(tempfile.mkdtemp()) / "random-parallel", shapes)
    device, dtype = ("cpu", "float32") if smoke else ("cuda", "float16")
    prompts = [list(range(3 + 11 * i, 3 + 11 * i + 64)) for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=8 if smoke else 64, ignore_eos=True, detokenize=False)
    rows = {}
    for name, split in (("one_worker", {}), ("uni_tp3_pp2", dict(tensor_parallel_size=3, pipeline_parallel_size=2))):
        engine = LLMEngine(str(model_dir), device=device, dtype=dtype, cpu_gemm="numba", num_blocks=512, swap_space=0,
                           **split)
        logits, tokens = [], {}
        execute = engine.executor.execute_model

        def recorded(model_input, execute=execute, logits=logits):
            result = execute(model_input)
            logits.append(dev.asnumpy(result).astype(np.float32))
            return result

        engine.executor.execute_model = recorded
        for i, ids in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": ids}, params)
        started, steps = time.perf_counter(), 0
        while engine.has_unfinished_requests() and steps < 1000:
            steps += 1
            for o in engine.step():
                if o.finished:
                    tokens[o.request_id] = o.outputs[0].token_ids
        rows[name] = dict(tokens=tokens, logits=logits, seconds_per_step=(time.perf_counter() - started) / steps)
        del engine
        release_device_memory()
    one, split = rows["one_worker"], rows["uni_tp3_pp2"]
    if len(one["logits"]) != len(split["logits"]):
        raise AssertionError(f"the split took {len(split['logits'])} forward passes, one worker "
                             f"{len(one['logits'])}: the driver should plan the same steps")
    diff = max([float(np.max(np.abs(a - b))) for a, b in zip(one["logits"], split["logits"]) if a.size] or [0.0])
    out["parallel"] = {"uni_tp3_pp2": {"same_tokens": one["tokens"] == split["tokens"], "max_logit_diff": diff,
                                       "seconds_per_step": split["seconds_per_step"],
                                       "one_worker_seconds_per_step": one["seconds_per_step"]}}
    gpus = 0 if smoke else int(dev.xp.cuda.runtime.getDeviceCount())
    out["parallel"]["nccl_over_ray"] = ("skipped: needs at least 2 GPUs, this machine has "
                                        f"{gpus}" if gpus < 2 else "run tests/test_gpu.py -k nccl")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=".", help="folder for gpu_results.json")
    p.add_argument("--smoke", action="store_true", help="run on the CPU harness with tiny shapes")
    p.add_argument("--preflight", action="store_true",
                   help="only check that the kernels compile and Numba CUDA launches (seconds)")
    p.add_argument("--section", choices=SECTIONS, action="append",
                   help="run only this step (repeatable), adding its results to gpu_results.json "
                        "(scripts/gpu_check.sh runs each in its own process, under its own time limit)")
    p.add_argument("--record", nargs=3, metavar=("STEP", "EXIT", "SECONDS"),
                   help="record a step's exit status and seconds in gpu_results.json (the script does, "
                        "so a step it had to kill is in the results too)")
    args = p.parse_args(argv)
    if args.preflight:
        return preflight(args.smoke)
    out_file = Path(args.out) / "gpu_results.json"
    out_file.parent.mkdir(parents=True, exist_ok=True)
    merge = bool(args.section or args.record)      # one step of many: add to what is there
    report: dict = json.loads(out_file.read_text()) if merge and out_file.exists() else {}
    report.setdefault("date", time.strftime("%Y-%m-%d"))
    if args.record:
        step, status, seconds = args.record
        report.setdefault("steps", {})[step] = {"exit": int(status), "seconds": int(seconds),
                                                "timed_out": int(status) in (124, 137)}
        out_file.write_text(json.dumps(report, indent=2, default=str))
        return 0

    def section(name: str, fn) -> None:
        """Run one step; a failure is recorded and the next step still runs. The results so
        far are written after every step, so a time-out loses only the step it hit."""
        started = time.perf_counter()
        report.get("errors", {}).pop(name, None)
        try:
            fn()
        except Exception as err:  # noqa: BLE001 (one broken step must not lose the others)
            report.setdefault("errors", {})[name] = f"{type(err).__name__}: {err}"
        report.setdefault("seconds", {})[name] = round(time.perf_counter() - started, 1)
        out_file.write_text(json.dumps(report, indent=2, default=str))
        print(f"[gpu_check] {name}: {report['seconds'][name]} s", flush=True)

    chosen = args.section or [s for s in SECTIONS if s != "warm_cpu"]
    dev = None
    if any(s in DEVICE_SECTIONS for s in chosen):
        dev = Device(args.smoke)

    def attention():
        report["attention"] = kernel_report(dev, args.smoke)
        bandwidth = report.get("copy_bandwidth_gb_per_s")
        for row in report["attention"]:
            if "kv_gb_per_s" in row and bandwidth:     # not a skipped row
                row["share_of_copy_bandwidth"] = row["kv_gb_per_s"] / bandwidth

    def device():
        report.update(dev.info())
        report["copy_bandwidth_gb_per_s"] = copy_bandwidth(dev, 4 if args.smoke else 2048) / 1e9

    steps = {
        "versions": lambda: report.update(versions=versions()),
        "warm_cpu": lambda: report.update(warm_cpu=warm_cpu(args.smoke)),
        "device": device,
        "attention": attention,
        "other_kernels": lambda: report.update(other_kernels=elementwise_report(dev, args.smoke)),
        "block_copies": lambda: report.update(block_copies=block_copy_report(dev, args.smoke)),
        "models": lambda: report.update(models=model_report(dev, args.smoke)),
        "end_to_end": lambda: end_to_end(dev, args.smoke, report),
        "parallel": lambda: parallel_report(dev, args.smoke, report),
    }
    for name in chosen:
        section(name, steps[name])
    print(json.dumps({k: report[k] for k in chosen if k in report} if args.section else report, indent=2,
                     default=str))
    return 1 if any(name in report.get("errors", {}) for name in chosen) else 0


# the steps in the order scripts/gpu_check.sh runs them (warm_cpu beside the others, in the
# background); those that need the device (or, smoke, the CPU harness)
SECTIONS = ("versions", "warm_cpu", "device", "attention", "other_kernels", "block_copies", "models",
            "end_to_end", "parallel")
DEVICE_SECTIONS = SECTIONS[2:]


if __name__ == "__main__":
    raise SystemExit(main())
