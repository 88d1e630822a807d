"""Tutorial 20: choosing an engine by timing it, or how cpu_gemm="auto" decides.

Goal: the CPU has two engines for the linear layers' products, our own Numba kernels (the
panels and the persistent kernel of tutorials 14 and 19, BLAS for prefills) and Intel's
oneMKL with its packed GEMM (``kernels/fast/packed_gemm.py``). Which is faster is not written on the
CPU's box. A rule by maker ("oneMKL on Intel") was tried and was wrong: on a 2-core Xeon
(Sapphire Rapids) oneMKL lost every decode size, 36 against 50.5 tokens/s single-stream, and
the rule also switched off the persistent kernel. So ``cpu_gemm="auto"`` measures:

1. a step's **kind** follows from its rows: 1 (a single-stream decode), up to 128 (a batched
   decode, or a chat turn's short prompt), more (a prefill) (``kernels/fast/linear_paths.py``);
2. the first time a model shape loads on a machine with oneMKL, a model with both copies of
   its weights runs steps of each kind through each engine, alternating which goes first
   (``minipaged/engine/linear_calibration.py``), and each kind takes the engine whose median is
   lower (oneMKL must win by 5%: a tie is not worth a second copy of the weights);
3. the choice is kept in ``~/.cache/minipaged/linear_paths.json`` under a key of the machine
   (CPU model and flags, threads, library versions, the source of the kernels and of the
   forward) and the model's shape; later loads read it and time nothing. A model of which
   oneMKL would pack no weight (a toy) is never timed: it has nothing for oneMKL to do.

We time the engines here ourselves, watch the engine read the kept choice, and check that the
engine's tokens do not depend on it.

The OS analogy: Linux's boot-time benchmark. At boot the kernel times each of its RAID-6 and
XOR routines on the CPU it runs on ("raid6: avx512x4 gen() 18000 MB/s ... using algorithm
avx512x4") and keeps the fastest: the right routine depends on the chip in front of it, so it
is measured, not assumed.

Run it:  python tutorials/20_choosing_an_engine_by_timing.py
(MINIPAGED_TUTORIAL_MODEL=/path/to/a/llama/dir picks another model.)

Exercises (also printed at the end):
  1. Run  python -m minipaged bench roofline --batch-sizes 1,8,32 --prefill-lens 256  with
     --cpu-gemm numba, then --cpu-gemm mkl, then without the flag: the path column says which
     engine each row took. Does "auto" take the faster of the two rows each time?
  2. Set ROUNDS in minipaged/engine/linear_calibration.py to 1 and delete the cache file: run
     this tutorial a few times. Does the choice ever change? Which kind is the closest race,
     and what would MARGIN have to be to keep its choice steady?
  3. The batched kind is timed at 16 and 64 sequences only. Find (with bench roofline) a batch
     size where the other engine wins. What would a fourth kind cost, in copies of the
     weights, and what would it gain?
"""

import os
import statistics

from minipaged import LLM, SamplingParams  # before numpy: it sets up numpy's thread pools
import numba

from minipaged.engine import linear_calibration
from minipaged.kernels.fast.ops import FastOps
from minipaged.kernels.fast.tuning import DEFAULT_TUNING
from minipaged.kernels.fast.linear_paths import DECODE_MAX_ROWS, KIND_NAMES, PATHS, STEP_KINDS, step_kind
from minipaged.kernels.fast.packed_gemm import load_packed_gemm
from minipaged.model.config import LlamaConfig
from minipaged.model.fetch import resolve_model
from minipaged.model.weights import load_checkpoint
from minipaged.tools.measure import paths_taken

MODEL = os.environ.get("MINIPAGED_TUTORIAL_MODEL", "smollm2-135m-instruct")
ROUNDS = 2                    # timed rounds in step 2 (the engine's own timing takes 3)

print("1. A step's kind is its rows")
for rows in (1, 2, 64, DECODE_MAX_ROWS, DECODE_MAX_ROWS + 1, 2048):
    print(f"  {rows:5} rows: {KIND_NAMES[step_kind(rows)]}")
assert DECODE_MAX_ROWS == DEFAULT_TUNING.panel_max_rows   # where the panels (and the persistent kernel) stop
print(f"  up to {DECODE_MAX_ROWS} rows the panels multiply (and a decode step is one persistent kernel); "
      "past that, numpy's BLAS. oneMKL's packed copy could take any of them")

model_dir = resolve_model(MODEL)
config = LlamaConfig.from_dir(model_dir)
gemm = load_packed_gemm("auto", numba.get_num_threads())   # None without the mkl wheel
print(f"\n2. Each kind through each engine, on this machine ({MODEL})")
if gemm is None:
    print("  oneMKL is not installed here (pip install 'minipaged[mkl]', Linux x86-64): there is one "
          "engine, nothing to choose, and cpu_gemm='auto' times nothing")
else:
    seconds = linear_calibration.measure(config, load_checkpoint(model_dir), FastOps(), gemm, rounds=ROUNDS)
    cases = linear_calibration.STEP_CASES
    print(f"  one warm round, then {ROUNDS} timed, alternating which engine goes first; ms, median:")
    print(f"  {'kind':22} {'steps (sequences x tokens)':>28} " + " ".join(f"{p:>8}" for p in PATHS) + "   faster")
    for kind in STEP_KINDS:
        medians = {path: statistics.median(seconds[kind][path]) for path in PATHS}
        steps = ", ".join("prefill" if seqs == "prefill" else f"{seqs}x{tokens}" for seqs, tokens in cases[kind])
        print(f"  {KIND_NAMES[kind]:22} {steps:>28} " + " ".join(f"{1e3 * medians[p]:8.1f}" for p in PATHS)
              + f"   {min(medians, key=medians.get)}")
        assert all(len(seconds[kind][p]) == ROUNDS and min(seconds[kind][p]) > 0 for p in PATHS)
    chosen = linear_calibration.choose(seconds)
    print(f"  so, with oneMKL needing a {linear_calibration.MARGIN:.0%} lead: {chosen.describe()}")
    print("  (a timing on a shared host moves from run to run; where the two are close, either is within noise)")

print("\n3. The engine reads the kept choice")
llm = LLM(MODEL, device="cpu", num_blocks=64, max_model_len=512, kernels="fast")   # cpu_gemm="auto", the default
model = llm.llm_engine.model
print(f"  LLM(..., cpu_gemm='auto'): {llm.llm_engine.backend.ops.linear_paths.describe()}")
print(f"  copies of the weights it holds: {', '.join(model.weights.tier_state.paths_made)} "
      "(the panels where some kind takes ours, oneMKL's packed layout where some kind takes it)")
if gemm is not None:
    cache = linear_calibration.CalibrationCache()
    machine = linear_calibration.machine_key(numba.get_num_threads())
    key = linear_calibration.entry_key(machine, linear_calibration.shape_key(config))
    assert cache.get(key) == llm.llm_engine.backend.ops.linear_paths            # what the file holds for this machine and shape
    print(f"  kept in {cache.path}, under this machine: {machine['cpu_model']}, {machine['threads']} threads, "
          f"oneMKL {machine['mkl']}, code {machine['code']}: a new CPU, library or kernel is timed afresh")
else:
    assert llm.llm_engine.backend.ops.linear_paths.used() == ("numba",)

print("\n4. Every step says which engine it took; the tokens hardly care")
params = SamplingParams(temperature=0.0, max_tokens=12)
prompts, alone = ["The page cache keeps", "A block table maps"], "A frame is"
runs = {}
for name in ("auto", "numba") + (("mkl",) if gemm is not None else ()):
    llm = llm if name == "auto" else LLM(MODEL, device="cpu", num_blocks=64, max_model_len=512, cpu_gemm=name,
                                                 kernels="fast")
    outputs = llm.generate(prompts, params, use_tqdm=False)                   # two together: batched steps
    outputs += llm.generate([alone], params, use_tqdm=False)                  # one alone: single-stream steps
    runs[name] = [o.outputs[0].token_ids for o in outputs]
    print(f"  cpu_gemm={name!r:8} {paths_taken(llm.llm_engine)}")   # from the fast tier's count (FastState.steps_by_path)
    if name == "auto":
        auto_paths = llm.llm_engine.backend.ops.linear_paths
        assert all(path == auto_paths.for_kind(kind) for kind, path in llm.llm_engine.model.weights.tier_state.steps_by_path)
    llm = None                                             # let its weights go before the next
used = auto_paths.used()
if len(used) == 1:      # one engine for every kind: the very floats of that engine asked for by name
    assert runs["auto"] == runs[used[0]]
    print(f"  'auto' took {used[0]} for every kind: its tokens are {used[0]}'s, bit for bit")
same = all(tokens == runs["numba"] for tokens in runs.values())
print(f"  the same greedy tokens from every engine: {same} (the engines add in different orders, so a "
      "near-tie between two tokens may fall either way)")

print("\nDone: each kind of step runs on the engine this machine measured faster, and the choice is "
      "timed once, then read.")
print("\nExercises:\n" + __doc__.split("Exercises (also printed at the end):\n")[1].split("\n\n")[0].rstrip())
