"""Tutorial 12: the production knobs, and the metrics that say a knob is wrong.

Goal: a serving engine has a handful of settings that decide how much memory
it takes and how much work it accepts, and get_stats() counters that say when
one of them is set badly. First, the ConfigError a bad value gives before any
weight is loaded. Then each main knob gets a small real run: how the KV pool
size comes from num_blocks, kv_cache_space or (on a GPU)
gpu_memory_utilization; how max_num_seqs and max_num_batched_tokens cap a step;
what enable_chunked_prefill changes about that cap; what preemption_mode and
swap_space do when the pool is too small (and how a swap space that is too
small quietly turns swapping into recomputation); what the watermark holds
back; what enable_prefix_caching saves. Last, the metrics to watch, read off
those same runs. The pool arithmetic uses SmolLM2-135M-Instruct; the scheduling
runs use a tiny random Llama (the tests' model), because they count steps and
blocks, not words.

The OS analogy: these are the boot parameters and sysctls of the kernel: how
much RAM it claims (the KV pool), the swap partition (swap_space), the
run-queue limits (max_num_seqs, the token budget), the free-memory reserve
(watermark), the page cache (prefix caching); and get_stats() is `top` and
`vmstat`: the run queue, memory in use, swap activity, the page-cache hit rate.

Run it:  python tutorials/12_production_knobs.py
(MINIPAGED_TUTORIAL_MODEL=/path/to/a/llama/dir picks another model for step 2.)

Exercises (also printed at the end):
  1. In step 5, give the "swap, swap_space 2 blocks" run (SMALL_SWAP_BLOCKS) exactly as many
     CPU blocks as the largest request's final table takes. Does it swap now, or still
     recompute? Read _preempt in minipaged/scheduler/scheduler.py to check.
  2. In step 3, set CAPPED (the capped run's knobs) to dict(max_num_seqs=8,
     max_num_batched_tokens=40, enable_chunked_prefill=True). Which knob now sets the pace,
     and what do num_waiting and the TTFT steps show?
"""

import contextlib
import io
import os
import tempfile
from pathlib import Path

from minipaged import LLMEngine, RequestError, SamplingParams  # before numpy: it sets up numpy's thread pools
from minipaged.tools.workloads import make_prompts
from minipaged.memory.block_manager import blocks_for
from minipaged.engine.cache_engine import DEFAULT_CPU_KV_SPACE_GIB, GIB
from minipaged.entrypoints.cli import main as cli_main
from minipaged.config import CacheConfig, ConfigError, SchedulerConfig
from minipaged.kernels.layout import kv_bytes_per_block
from minipaged.model.random_llama import write_tiny_llama
from minipaged.scheduler.scheduler import AUTO_RECOMPUTE_MAX_TOKENS

MODEL = os.environ.get("MINIPAGED_TUTORIAL_MODEL", "smollm2-135m-instruct")
TMP = tempfile.TemporaryDirectory()
TINY = str(write_tiny_llama(Path(TMP.name) / "tiny", seed=0))  # 3 layers, 2 KV heads, head_dim 16


def tiny_engine(**knobs) -> LLMEngine:
    return LLMEngine(TINY, device="cpu", **{"block_size": 16, "swap_space": 0, **knobs})


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], int]]) -> dict:
    """Add every request at once, step until done; what each step did, and each request's result."""
    steps, first_token, tokens = [], {}, {}
    schedule = engine.scheduler.schedule

    def schedule_and_keep():
        plan = schedule()
        prefills = [(s.group.request_id, s.num_new_tokens) for s in plan.scheduled if s.is_prefill]
        steps.append({"tokens": plan.num_batched_tokens, "seqs": len(plan.scheduled), "prefills": prefills})
        return plan

    engine.scheduler.schedule = schedule_and_keep
    for rid, (prompt, n) in requests.items():
        engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    while engine.has_unfinished_requests():
        outputs = engine.step()
        s = engine.get_stats()
        steps[-1].update(running=s["num_running"], waiting=s["num_waiting"], swapped=s["num_swapped"],
                         kv_usage=s["kv_usage"], log=engine.metrics.log_line(s))   # the periodic log line
        for out in outputs:
            first_token.setdefault(out.request_id, len(steps))
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
        engine.block_manager.check_invariants()
    engine.scheduler.schedule = schedule
    return {"steps": steps, "first_token_step": first_token, "tokens": tokens, "stats": engine.get_stats()}


def error_of(make) -> str:
    try:
        make()
    except (ConfigError, RequestError) as err:
        return f"{type(err).__name__}: {err}"
    raise AssertionError("no error")


# ------------------------------------------------------------------------------------------ 1
print("1. A bad value fails at once, with a sentence that names the knob")
bad = {
    "block_size=12": lambda: CacheConfig(block_size=12),
    "gpu_memory_utilization=1.5": lambda: CacheConfig(gpu_memory_utilization=1.5),
    "swap_space=-1": lambda: CacheConfig(swap_space=-1),
    "watermark=1.0": lambda: CacheConfig(watermark=1.0),
    "preemption_mode='lru'": lambda: SchedulerConfig(max_model_len=512, preemption_mode="lru"),
    "max_num_seqs=64, max_num_batched_tokens=32":
        lambda: SchedulerConfig(max_model_len=32, max_num_seqs=64, max_num_batched_tokens=32),
    "max_model_len=512, max_num_batched_tokens=256":
        lambda: SchedulerConfig(max_model_len=512, max_num_batched_tokens=256),
}
for knob, make in bad.items():
    message = error_of(make)
    print(f"  {knob:46} -> {message}")
    assert message.startswith("ConfigError: ") and knob.split("=")[0] in message
# The engine checks its settings before it loads the weights: EngineConfig, CacheConfig and the
# ones that need no model before anything else; those that need the model's max length (like
# this SchedulerConfig one) once the model directory is found (which may mean fetching it).
message = error_of(lambda: tiny_engine(max_num_batched_tokens=256, max_num_seqs=4))
print(f"  LLMEngine(..., max_num_batched_tokens=256): {message[:78]}...")
assert "enable_chunked_prefill" in message
stderr = io.StringIO()
with contextlib.redirect_stderr(stderr):
    code = cli_main(["generate", "hello", "--model", TINY, "--device", "cpu", "--block-size", "12"])
print(f"  python -m minipaged generate ... --block-size 12  -> exit code {code}, stderr: "
      f"{stderr.getvalue().strip()!r}")
assert code == 1 and stderr.getvalue().startswith("error: block_size must be a power of two")
assert issubclass(ConfigError, ValueError)   # the CLI turns every ValueError into one 'error:' line

# ------------------------------------------------------------------------------------------ 2
print(f"\n2. How big is the KV pool? ({MODEL})")
SPACE, SWAP = 0.25, 0.125
real = LLMEngine(MODEL, device="cpu", kv_cache_space=SPACE, swap_space=SWAP)   # block_size 16
c, cache = real.model_config, real.cache
per_block = kv_bytes_per_block(c.num_hidden_layers, c.num_key_value_heads, 16, c.head_dim, 4)
print(f"  one block = 2 (K and V) x {c.num_hidden_layers} layers x {c.num_key_value_heads} KV heads x 16 "
      f"tokens x {c.head_dim} dims x 4 bytes (float32) = {per_block} bytes = {per_block // 16} bytes a token")
assert cache.bytes_per_block == per_block
print(f"  CPU: kv_cache_space={SPACE} GiB -> {cache.num_blocks} blocks ({cache.num_blocks * 16} token slots); "
      f"swap_space={SWAP} GiB -> {cache.num_cpu_blocks} CPU blocks")
assert cache.num_blocks == int(SPACE * GIB) // per_block
assert cache.num_cpu_blocks == int(SWAP * GIB) // per_block
default_blocks = int(DEFAULT_CPU_KV_SPACE_GIB * GIB) // per_block
print(f"  left at None, kv_cache_space is {DEFAULT_CPU_KV_SPACE_GIB:g} GiB: {default_blocks} blocks "
      f"({default_blocks * 16} slots); num_blocks=N, if given, overrides both this and the GPU sizing")
# On a GPU (float16 KV) the pool is what a profiling pass leaves of gpu_memory_utilization x memory:
#   num_blocks = (gpu_memory_utilization * total - peak of weights + activations) // bytes_per_block
# (profile_gpu_num_blocks in minipaged/engine/cache_engine.py). The weights we can count here; the
# activations are measured by that pass on the real GPU, so 1 GiB below is only an assumption.
weights = real.model.nbytes - real.model.rope.cos.nbytes - real.model.rope.sin.nbytes   # a tied head counted once
weights_fp16, activations, total = weights // 2, 1 * GIB, 24 * GIB
gpu_block = kv_bytes_per_block(c.num_hidden_layers, c.num_key_value_heads, 16, c.head_dim, 2)
print(f"  GPU (24 GiB card, float16): weights {weights_fp16 / GIB:.2f} GiB, assumed activation peak "
      f"{activations / GIB:.0f} GiB, {gpu_block} bytes a block:")
gpu_blocks = {}
for util in (0.5, 0.9, 0.95):
    gpu_blocks[util] = int((util * total - weights_fp16 - activations) // gpu_block)
    print(f"    gpu_memory_utilization={util:<4} -> {gpu_blocks[util]:6} blocks = "
          f"{gpu_blocks[util] * 16:7} token slots = {gpu_blocks[util] * 16 // 2048:3} full 2048-token contexts")
assert gpu_blocks[0.5] < gpu_blocks[0.9] < gpu_blocks[0.95]
print("  the share is of the whole card, not of what is free: the pass counts only this engine's arrays,"
      "\n  so another process on the GPU, or the CUDA context itself, must fit in the remaining share")
del real

# ------------------------------------------------------------------------------------------ 3
print("\n3. max_num_seqs caps how many sequences run in one step (tiny model from here on)")
WORK = {f"r{i}": (p, 8) for i, p in enumerate(make_prompts(8, 10, 30, 259, seed=0))}
CAPPED = dict(max_num_seqs=3)   # the capped run's knobs (exercise 2 changes them)
CAP_SEQS = CAPPED.get("max_num_seqs", 256)   # 256: the default
SEQS_ONLY = set(CAPPED) == {"max_num_seqs"}   # only the sequence cap: its effect can be computed
cap_name = ", ".join(f"{k}={v}" for k, v in CAPPED.items())
run(tiny_engine(num_blocks=64), WORK)   # a warm-up: loads the compiled kernels before TTFT is timed
runs = {"max_num_seqs=256 (default)": run(tiny_engine(num_blocks=64), WORK),
        cap_name: run(tiny_engine(num_blocks=64, **CAPPED), WORK)}
for name, r in runs.items():
    steps, s = r["steps"], r["stats"]
    print(f"  {name:27} {s['num_steps']:2} steps; running per step {[x['running'] for x in steps]}")
    print(f"  {'':27} waiting per step {[x['waiting'] for x in steps]}; first token at step "
          f"{list(r['first_token_step'].values())}")
capped, free_run = runs[cap_name], runs["max_num_seqs=256 (default)"]
assert max(x["seqs"] for x in capped["steps"]) == min(CAP_SEQS, len(WORK))
assert max(x["waiting"] for x in capped["steps"]) > 0
assert max(x["seqs"] for x in free_run["steps"]) == len(WORK) and free_run["steps"][0]["waiting"] == 0
assert max(capped["first_token_step"].values()) > max(free_run["first_token_step"].values())
assert capped["tokens"] == free_run["tokens"]
peak_usage = max(x["kv_usage"] for x in capped["steps"])
print(f"  the cap queued requests with the pool {peak_usage:.0%} full at most: "
      "num_waiting > 0 while kv_usage is low says the limit is the knob, not the memory")

print("\n4. max_num_batched_tokens caps the tokens of a step; enable_chunked_prefill cuts prompts to fit")
LONG = {f"L{i}": (p, 4) for i, p in enumerate(make_prompts(3, 100, 100, 259, seed=1))}
MAX_LEN, SMALL = 128, 32
budget = dict(num_blocks=64, max_model_len=MAX_LEN, max_num_seqs=16)
chunk_runs = {
    f"whole prompts, budget {MAX_LEN}": run(tiny_engine(**budget, max_num_batched_tokens=MAX_LEN), LONG),
    f"chunked, budget {MAX_LEN}": run(tiny_engine(**budget, max_num_batched_tokens=MAX_LEN,
                                                 enable_chunked_prefill=True), LONG),
    f"chunked, budget {SMALL}": run(tiny_engine(**budget, max_num_batched_tokens=SMALL,
                                               enable_chunked_prefill=True), LONG),
}
for name, r in chunk_runs.items():
    print(f"  {name:24} tokens per step {[x['tokens'] for x in r['steps']]}")
    print(f"  {'':24} prompt tokens per step {[sum(n for _, n in x['prefills']) for x in r['steps']]}, "
          f"first tokens at steps {list(r['first_token_step'].values())}")
whole, filled, small = chunk_runs.values()
assert all(x["tokens"] <= MAX_LEN for r in (whole, filled) for x in r["steps"])
assert all(len(x["prefills"]) <= 1 for x in whole["steps"])   # a 100-token prompt runs whole: one per step
assert max(x["tokens"] for x in whole["steps"]) < MAX_LEN
split = [rid for rid in LONG if sum(p[0] == rid for x in filled["steps"] for p in x["prefills"]) > 1]
assert split and max(x["tokens"] for x in filled["steps"]) == MAX_LEN
assert max(x["tokens"] for x in small["steps"]) == SMALL          # impossible without chunking (step 1)
assert whole["tokens"] == filled["tokens"] == small["tokens"]
print(f"  whole prompts: one prefill a step, the budget never full; chunked: {split} split so every step"
      f"\n  is filled to {MAX_LEN}; budget {SMALL} (< max_model_len, allowed only with chunking): no step ever"
      f"\n  computes more than {SMALL} tokens. Same outputs in all three. A small budget bounds how long"
      "\n  any one step (and every decode in it) takes; a big one finishes prompts sooner (TTFT).")

# ------------------------------------------------------------------------------------------ 5
print("\n5. Too little KV memory: preemption_mode, swap_space, and the watermark")
PRESSURE = {f"P{i}": (p, 40) for i, p in enumerate(make_prompts(4, 70, 80, 259, seed=2))}
need = {rid: blocks_for(len(p) + n - 1, 16) for rid, (p, n) in PRESSURE.items()}
POOL = 18
tiny_block = kv_bytes_per_block(3, 2, 16, 16, 4)
print(f"  4 requests of 70-80 prompt tokens + 40 new ones; their final tables take {list(need.values())} "
      f"blocks = {sum(need.values())} in all; the pool has {POOL}")
SMALL_SWAP_BLOCKS = 2                     # the small swap space, in blocks (exercise 1 changes it)
big_swap = 64 * tiny_block / GIB          # room for 64 blocks
small_swap = SMALL_SWAP_BLOCKS * tiny_block / GIB
# A running request holds at least its prompt's blocks: a swap space smaller than the shortest
# prompt can take no victim at all (at 2 blocks, less than any request holds).
too_small = SMALL_SWAP_BLOCKS < min(blocks_for(len(p), 16) for p, _ in PRESSURE.values())
ROOMY, CRAMPED = "swap, swap_space 64 blocks", f"swap, swap_space {SMALL_SWAP_BLOCKS} blocks"
pressure = {
    ROOMY: dict(preemption_mode="swap", swap_space=big_swap),
    CRAMPED: dict(preemption_mode="swap", swap_space=small_swap),
    "recompute": dict(preemption_mode="recompute"),
}
reference = run(tiny_engine(num_blocks=64), PRESSURE)
print(f"  {'run':28} {'steps':>5} {'preempt':>7} {'swap':>4} {'recomp':>6} {'blocks out':>10} "
      f"{'cpu pool':>8} {'prompt tokens':>13}")
results = {}
for name, knobs in pressure.items():
    r = results[name] = run(tiny_engine(num_blocks=POOL, **knobs), PRESSURE)
    s = r["stats"]
    print(f"  {name:28} {s['num_steps']:5} {s['num_preemptions']:7} {s['num_preemptions_swap']:4} "
          f"{s['num_preemptions_recompute']:6} {s['blocks_swapped_out']:10} {s['cpu_kv_blocks_total']:8} "
          f"{s['prompt_tokens']:13}")
    assert s["num_preemptions"] > 0 and r["tokens"] == reference["tokens"]
roomy, cramped, recompute = (results[n]["stats"] for n in pressure)
assert roomy["num_preemptions_recompute"] == 0 < roomy["num_preemptions_swap"]
assert roomy["prompt_tokens"] == reference["stats"]["prompt_tokens"]
assert cramped["cpu_kv_blocks_total"] == SMALL_SWAP_BLOCKS
again = cramped["prompt_tokens"] - roomy["prompt_tokens"]
if too_small:
    assert cramped["num_preemptions_swap"] == 0
    assert cramped["num_preemptions_recompute"] == cramped["num_preemptions"]   # every swap fell back
    assert again > 0
    assert (cramped["num_steps"], cramped["prompt_tokens"]) == (recompute["num_steps"], recompute["prompt_tokens"])
    print(f"  with {SMALL_SWAP_BLOCKS} CPU blocks the victim did not fit the swap space, so preemption_mode='swap'"
          f" quietly\n  recomputed it, exactly as the recompute run did: num_preemptions_swap 0, and {again} prompt"
          "\n  tokens computed again. Outputs identical in every run.")
else:
    print(f"  with {SMALL_SWAP_BLOCKS} CPU blocks: num_preemptions_swap {cramped['num_preemptions_swap']}, "
          f"num_preemptions_recompute {cramped['num_preemptions_recompute']}, {again} prompt tokens"
          "\n  computed again. Outputs identical in every run.")
print(f"  preemption_mode='auto' (the default) recomputes victims holding <= {AUTO_RECOMPUTE_MAX_TOKENS} "
      "tokens and swaps the rest")
# The watermark: admission keeps int(watermark * num_blocks) blocks free for running requests to grow.
wm_engine = tiny_engine(block_size=4, num_blocks=100)
bm = wm_engine.block_manager
print(f"  watermark {CacheConfig().watermark} of {bm.num_blocks} blocks = {bm.watermark_blocks} block held "
      f"back (a CacheConfig field; LLMEngine always uses\n  the default); a request that needs all "
      f"{bm.num_blocks} is refused at add_request, before it can wait forever:")
message = error_of(lambda: wm_engine.add_request("huge", [3 + i % 256 for i in range(300)],
                                                 SamplingParams(max_tokens=100, ignore_eos=True)))
print(f"    {message}")
assert bm.watermark_blocks == 1 and "only 99 usable blocks" in message
assert not wm_engine.has_unfinished_requests()

# ------------------------------------------------------------------------------------------ 6
print("\n6. enable_prefix_caching: the same 64-token prefix in front of four prompts")
prefix = make_prompts(1, 64, 64, 259, seed=3)[0]
tails = make_prompts(4, 10, 20, 259, seed=4)
SHARED = {f"S{i}": (prefix + [3 + i] + tail, 4) for i, tail in enumerate(tails)}  # differ right after it
caching = {on: run(tiny_engine(num_blocks=64, enable_prefix_caching=on), SHARED) for on in (False, True)}
for on, r in caching.items():
    s = r["stats"]
    print(f"  caching {'on ' if on else 'off'}: prompt tokens computed {s['prompt_tokens']:3}, "
          f"prefix_cache_hit_rate {s['prefix_cache_hit_rate']:.0%} "
          f"({s['prefix_cache_hits']}/{s['prefix_cache_queries']})")
on, off = caching[True]["stats"], caching[False]["stats"]
assert on["prefix_cache_hits"] == 3 * 64 and off["prompt_tokens"] - on["prompt_tokens"] == 3 * 64
assert caching[True]["tokens"] == caching[False]["tokens"]

# ------------------------------------------------------------------------------------------ 7
print("\n7. The metrics to watch, read off the runs above")


def diagnose(r: dict) -> list[str]:
    """What get_stats() and the per-step queue lengths say about the knobs."""
    s, steps, found = r["stats"], r["steps"], []
    if s["num_preemptions"]:
        found.append("preemptions: the pool is too small for this load (num_blocks, kv_cache_space, "
                      "gpu_memory_utilization up, or max_num_seqs down)")
    if s["num_preemptions_recompute"] and s["num_preemptions_swap"] == 0 and s["cpu_kv_blocks_total"]:
        found.append("a swap space that swapped nothing: swap_space too small for any victim")
    queued = any(x["waiting"] for x in steps)
    if queued and max(x["kv_usage"] for x in steps) < 0.5 and not s["num_preemptions"]:
        found.append("requests waited with the pool half empty: max_num_seqs or max_num_batched_tokens caps")
    if s["prefix_cache_queries"] and s["prefix_cache_hit_rate"] > 0.3:
        found.append("prefix cache hit rate high: shared prompts are being reused")
    return found or ["nothing to change"]


CAP_KEY, CRAMPED_KEY = f"3. {cap_name}", f"5. swap, {SMALL_SWAP_BLOCKS} CPU blocks"
watched = {CAP_KEY: capped, "3. default": free_run,
           "5. swap, 64 CPU blocks": results[ROOMY],
           CRAMPED_KEY: results[CRAMPED], "6. caching on": caching[True]}
findings = {}
for name, r in watched.items():
    findings[name] = diagnose(r)
    for line in findings[name]:
        print(f"  {name:24} {line}")
assert findings["3. default"] == ["nothing to change"]
assert findings[CAP_KEY][0].startswith("requests waited")
assert findings["5. swap, 64 CPU blocks"] == findings[CRAMPED_KEY][:1]
if too_small:
    assert findings[CRAMPED_KEY][1].startswith("a swap space that swapped nothing")
assert findings["6. caching on"][0].startswith("prefix cache hit rate high")
print("  latency: get_stats() has ttft_p50/p99 and tpot_p50/p99 in seconds:")
for name, r in ((cap_name, capped), ("default", free_run)):
    s = r["stats"]
    print(f"    {name:15} TTFT p50 {s['ttft_p50'] * 1e3:6.1f} ms, p99 {s['ttft_p99'] * 1e3:6.1f} ms; TPOT p50 "
          f"{s['tpot_p50'] * 1e3:5.2f} ms; first tokens at steps {sorted(r['first_token_step'].values())}")
    assert s["ttft_p99"] >= s["ttft_p50"] > 0 and s["tpot_p50"] > 0
last_first = max(capped["first_token_step"].values())
print("    queueing shows as a TTFT p99 well above the p50 while TPOT stays flat. Here a step of the"
      "\n    tiny model takes about a millisecond, as short as the timer's noise, so read the steps"
      f"\n    instead: with {cap_name} the last requests waited {last_first - 1} steps for their first token."
      "\n    On a real model every one of those steps costs tens of milliseconds.")
if SEQS_ONLY:   # batches of CAP_SEQS, each a prefill step and 7 decode steps long
    batches = -(-len(WORK) // CAP_SEQS)
    assert last_first == 1 + 8 * (batches - 1)   # 17 for max_num_seqs=3
assert sorted(free_run["first_token_step"].values())[-1] == 1
print("  the periodic log line (every log_stats_interval seconds; the CLI's generate and bench print it")
print(f"  every 5 s), here after step 1 of the {cap_name} run and after the swap run's preemption:")
swap_run = results[ROOMY]
swapped_at = next(i for i, x in enumerate(swap_run["steps"]) if x["swapped"])
for line in (capped["steps"][0]["log"], swap_run["steps"][swapped_at]["log"]):
    print("    ..." + line[line.index("Running:"):])
if SEQS_ONLY and CAP_SEQS < len(WORK):
    assert (f"Running: {CAP_SEQS} reqs, Swapped: 0 reqs, Pending: {len(WORK) - CAP_SEQS} reqs"
            in capped["steps"][0]["log"])
assert "Swapped: 1 reqs" in swap_run["steps"][swapped_at]["log"]
assert "Preemptions: 1 (swap 1, recompute 0)" in swap_run["steps"][swapped_at]["log"]
print("\nDone: size the pool first, then let the queue lengths and the preemption counters tune the rest.")
print("\nExercises:\n" + __doc__.split("Exercises (also printed at the end):\n")[1].split("\n\n")[0].rstrip())
TMP.cleanup()
