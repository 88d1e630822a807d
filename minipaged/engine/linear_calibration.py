"""Linear calibration: each kind of step's engine, timed once per machine (Linux's boot-time benchmark).

When Linux boots it times each of its RAID-6 and XOR routines on the CPU it finds ("raid6:
avx512x4 gen() ... using algorithm avx512x4") and keeps the fastest: which routine wins
depends on the chip, and a table written in advance would be wrong on the next one.
``cpu_gemm="auto"`` does the same for the two engines of the CPU's linear layers
(``kernels/linear_paths.py``): our own kernels ("numba") and oneMKL's packed GEMM ("mkl").
Which one wins is not a property of the CPU's maker. On a 2-core Xeon (Sapphire Rapids,
AVX-512 and AMX) oneMKL lost every decode size to the panels and the persistent kernel
(issue 39: 36 against 50.5 tok/s single-stream, 206 against 266 batched); on a 2-core EPYC it
lost everything (docs/benchmarks.md); and each change to either side moves the line.

So the first time a model shape loads on a machine with oneMKL installed:

1. one model is built with both copies of its weights (the panels and oneMKL's), and a small
   pool of its own;
2. each kind of step (``STEP_CASES``: one decode, decodes of 16 and 64 sequences, a 256-token
   prefill) runs through each engine, warmed once, then timed over ``ROUNDS`` rounds that
   alternate which engine goes first (so a slow spell of a shared host falls on both);
3. each kind takes the engine with the lower median; oneMKL must win by ``MARGIN``, or our
   kernels keep it (a tie is not worth a second copy of the weights);
4. the choice is written to ``$MINIPAGED_HOME/linear_paths.json``, under a key made of the
   machine (CPU model and flags, threads, oneMKL's, numpy's and Numba's versions, the source of
   the kernels, of the model's forward and of this module) and the model's shape. Later loads
   read it: no timing. (Delete the file to time again.) Two processes loading at once take turns
   (a lock beside the file): the second reads what the first measured.

Whole steps are timed, not the products alone: a decode step on the panels runs as one
persistent kernel, whose gain (no fork and join between kernels) a product-by-product timing
would not see. The first load pays a few seconds for it (SmolLM2 on a 2-core EPYC: ~7 s, once
per machine). A model of which oneMKL would pack no weight (a toy) is not timed: ours.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import importlib.metadata
import json
import logging
import os
import statistics
import time
from pathlib import Path

import numpy as np

from ..kernels.layout import kv_cache_shape
from ..kernels.fast.linear_paths import PATHS, STEP_KINDS, LinearPaths
from ..kernels.fast.packed_gemm import MIN_PACKED_ELEMENTS, cpuinfo_field
from ..model.config import LlamaConfig
from ..model.fetch import cache_dir
from ..model.llama import LlamaModel
from ..model.weights import load_checkpoint
from .backend import Backend
from .warm_up import dummy_input

logger = logging.getLogger("minipaged")

CACHE_FILE = "linear_paths.json"
FORMAT = 1                    # the file's layout; a different one is measured afresh
ROUNDS = 3                    # timed rounds of every kind through both engines, after a warm one
MARGIN = 0.05                 # oneMKL takes a kind only when its median is this much lower
BLOCK_SIZE = 16
DECODE_CONTEXT = BLOCK_SIZE + 1   # a decode step's context: two blocks, the second begun
PREFILL_ROWS = 256            # the prefill's tokens: past kernels/linear_paths.DECODE_MAX_ROWS
# (sequences, tokens each) of the steps timed for each kind; decode steps repeat so that a
# single-stream step (~25 ms on SmolLM2) is not lost in the timer's and the host's jitter
STEP_CASES = {"single_decode": ((1, 1),) * 4, "batched_decode": ((16, 1), (64, 1)), "prefill": (("prefill", 0),)}


# --------------------------------------------------------------------------- what a result is keyed by

def code_digest() -> str:
    """A digest of the code a timing depends on: the kernels, the model's forward and this
    module (its steps, rounds and margin). A change to any of them is timed afresh."""
    from .. import kernels  # noqa: PLC0415 (the package's folders, wherever it is installed)
    from ..model import llama  # noqa: PLC0415

    digest = hashlib.sha256()
    for path in [*sorted(Path(kernels.__file__).parent.glob("*.py")), Path(llama.__file__), Path(__file__)]:
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def machine_key(num_threads: int) -> dict:
    """What decides which engine is faster, apart from the model: the CPU, its threads, the libraries."""

    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None
    flags = cpuinfo_field("flags") or ""
    return {"cpu_model": cpuinfo_field("model name"), "vendor": cpuinfo_field("vendor_id"),
            "flags": hashlib.sha256(flags.encode()).hexdigest()[:16],
            "threads": num_threads, "mkl": version("mkl"), "numpy": np.__version__,
            "numba": version("numba"), "code": code_digest()}


def shape_key(config: LlamaConfig) -> dict:
    """The model's shape, all the timing depends on (its weights' values do not matter)."""
    return {"hidden": config.hidden_size, "ffn": config.intermediate_size, "layers": config.num_hidden_layers,
            "heads": config.num_attention_heads, "kv_heads": config.num_key_value_heads,
            "head_dim": config.head_dim, "vocab": config.vocab_size, "tied": bool(config.tie_word_embeddings)}


def packs_anything(config: LlamaConfig) -> bool:
    """Whether oneMKL would pack any of the model's linear weights (``MIN_PACKED_ELEMENTS``): if
    none, its engine would multiply nothing of its own, and there is nothing to time."""
    h = config.hidden_size
    sizes = [(config.q_size + 2 * config.kv_size) * h, h * config.q_size, 2 * config.intermediate_size * h,
             h * config.intermediate_size, config.vocab_size * h]
    return max(sizes) >= MIN_PACKED_ELEMENTS


def entry_key(machine: dict, shape: dict) -> str:
    return hashlib.sha256(json.dumps([machine, shape], sort_keys=True).encode()).hexdigest()[:24]


# --------------------------------------------------------------------------- timing

def measure(config: LlamaConfig, tensors: dict, ops, gemm, rounds: int = ROUNDS) -> dict[str, dict[str, list[float]]]:
    """Seconds of each kind's steps (``STEP_CASES``) through each engine: {kind: {path: [s, ...]}},
    ``rounds`` values each, after one untimed warm round."""
    max_positions = min(config.max_position_embeddings, PREFILL_ROWS)
    both = LinearPaths(single_decode="numba", batched_decode="mkl", prefill="mkl")   # holds both copies
    model = LlamaModel(config, tensors, ops.with_paths(both, gemm), max_positions=max_positions)   # both copies
    prompt = max_positions                               # (prompts of this length) x seqs > DECODE_MAX_ROWS
    prompts = -(-PREFILL_ROWS // prompt)
    blocks = max(64 * -(-DECODE_CONTEXT // BLOCK_SIZE), prompts * -(-prompt // BLOCK_SIZE))
    kv = np.zeros(kv_cache_shape(config.num_hidden_layers, blocks, config.num_key_value_heads, BLOCK_SIZE,
                                 config.head_dim), np.float32)   # (layers, 2, blocks, kv_heads, block, head_dim)
    steps = {}
    for kind, cases in STEP_CASES.items():
        steps[kind] = [dummy_input(prompts, prompt, prompt, BLOCK_SIZE, config.vocab_size) if seqs == "prefill"
                       else dummy_input(seqs, query, min(DECODE_CONTEXT, max_positions), BLOCK_SIZE, config.vocab_size)
                       for seqs, query in cases]

    def run(kind: str, path: str) -> float:
        model.ops = ops.with_paths(LinearPaths.every(path), gemm)   # both copies are there: either engine runs
        start = time.perf_counter()
        for step in steps[kind]:
            model.forward(step.input_ids, step.positions, kv, step.meta, step.logits_indices)
        return time.perf_counter() - start

    seconds = {kind: {path: [] for path in PATHS} for kind in STEP_KINDS}
    for r in range(rounds + 1):
        for kind in STEP_KINDS:
            for path in (PATHS if r % 2 else PATHS[::-1]):   # who goes first alternates
                took = run(kind, path)
                if r:                                       # round 0 warms (loads kernels, faults pages)
                    seconds[kind][path].append(took)
    return seconds


def choose(seconds: dict[str, dict[str, list[float]]], margin: float = MARGIN) -> LinearPaths:
    """Each kind's engine from its timings: oneMKL where its median is ``margin`` below ours."""
    picks = {}
    for kind in STEP_KINDS:
        ours, mkl = (statistics.median(seconds[kind][path]) for path in ("numba", "mkl"))
        picks[kind] = "mkl" if mkl < (1.0 - margin) * ours else "numba"
    return LinearPaths(**picks)


# --------------------------------------------------------------------------- the cache of results

class CalibrationCache:
    """``linear_paths.json``: one entry a machine and model shape, {key: {"paths": ..., ...}}."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else cache_dir() / CACHE_FILE

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        entries = data.get("entries") if isinstance(data, dict) and data.get("format") == FORMAT else None
        return entries if isinstance(entries, dict) else {}

    def get(self, key: str) -> LinearPaths | None:
        entry = self._read().get(key)
        try:
            return LinearPaths(**entry["paths"]) if entry else None
        except (TypeError, KeyError, ValueError):   # an entry of another version: measure again
            return None

    @contextlib.contextmanager
    def locked(self):
        """Hold the file's lock (``flock`` on a file beside it): one process times at a time, and
        the next reads what it kept. Without a writable folder, no lock: each times on its own."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            handle = open(self.path.with_name(self.path.name + ".lock"), "a")
        except OSError:
            yield
            return
        with handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def put(self, key: str, entry: dict) -> None:
        """Add an entry (written to a new file, then renamed: a reader never sees half of one)."""
        entries = {**self._read(), key: entry}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"format": FORMAT, "entries": entries}, indent=1, sort_keys=True))
        os.replace(tmp, self.path)


# --------------------------------------------------------------------------- the engine's entry point

def settle_linear_paths(backend: Backend, config: LlamaConfig, model_dir, cache: CalibrationCache | None = None,
                        measure_fn=None) -> Backend:
    """The backend with its ``linear_paths`` decided. Asked for (``cpu_gemm`` "numba" or "mkl"),
    or without oneMKL, they are already; with "auto" and oneMKL, for a model of which oneMKL would
    pack no weight (``packs_anything``), ours; otherwise they come from the cache, or are
    measured (``measure_fn(config, tensors, ops, gemm)``, default ``measure``, on the checkpoint in
    ``model_dir``) and cached. oneMKL stays loaded only where some kind of step uses it."""
    if backend.linear_paths is not None:
        return backend
    if not packs_anything(config):          # a toy model: oneMKL would pack none of its weights
        return backend.with_linear_paths(LinearPaths.every("numba"), None)
    cache = cache or CalibrationCache()
    machine, shape = machine_key(backend.gemm.num_threads), shape_key(config)
    key = entry_key(machine, shape)
    paths = cache.get(key)
    if paths is None:
        with cache.locked():                # another process may be timing this very shape
            paths = cache.get(key) or _measure_and_keep(backend, config, model_dir, cache, key, machine, shape,
                                                        measure_fn or measure)
    return backend.with_linear_paths(paths, backend.gemm if "mkl" in paths.used() else None)


def _measure_and_keep(backend: Backend, config: LlamaConfig, model_dir, cache: CalibrationCache, key: str,
                      machine: dict, shape: dict, measure_fn) -> LinearPaths:
    """Time the engines on this machine (``measure_fn``), choose, and keep the choice under ``key``."""
    logger.info("cpu_gemm='auto': timing each kind of step through our kernels and oneMKL, once for this "
                "machine and model shape (kept in %s)", cache.path)
    start = time.perf_counter()
    seconds = measure_fn(config, load_checkpoint(model_dir), backend.ops, backend.gemm)
    paths = choose(seconds)
    medians = {kind: {path: round(1e3 * statistics.median(s), 3) for path, s in by_path.items()}
               for kind, by_path in seconds.items()}
    try:
        cache.put(key, {"paths": paths.as_dict(), "median_ms": medians, "machine": machine, "shape": shape,
                        "measured": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                        "took_s": round(time.perf_counter() - start, 2)})
    except OSError as err:                  # a read-only home: timed again next time
        logger.warning("could not keep the linear paths' timing in %s (%s)", cache.path, err)
    logger.info("linear paths: %s (medians, ms: %s)", paths.describe(), medians)
    return paths
