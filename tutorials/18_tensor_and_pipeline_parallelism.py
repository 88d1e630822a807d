"""Tutorial 18: one block table, many workers, each pool holding different heads.

Goal: split the model over workers and see that the memory manager does not notice. The
driver keeps one scheduler, one block manager and one block table per sequence; each worker
holds a slice of the model and a KV pool of its own, at the same block ids. We:

1. build the same engine three ways: one worker, three tensor-parallel ranks (``-tp 3``), two
   pipeline stages (``-pp 2``), and print what each worker holds: its heads, its MLP columns,
   its layers, the shape of its pool;
2. run one request on each, and look at one block id of its (one) block table: in the
   one-worker pool that block holds the K/V of all 3 KV heads; in the TP run, rank r's pool,
   at the same block id, holds head r's and nothing else; in the PP run, stage 1's pool holds
   the last half of the layers. The numbers agree with the one-worker pool's;
3. count the all-reduces of one step (two per layer), and check that every token is the same;
4. if Ray is installed, run the two stages as two actor processes, hidden states passing
   between them as Ray objects.

The OS analogy: a multiprocessor. One kernel (the driver) keeps the page tables; each
processor has its own local memory (NUMA), and a page-table entry names a frame in each of
them. The kernel decides once; every processor carries out the same plan on its own frames.

Run it:  python tutorials/18_tensor_and_pipeline_parallelism.py
(MINIPAGED_TUTORIAL_MODEL=/path/to/a/llama/dir picks another model; its KV heads must divide by 3.)

Exercises (also printed at the end):
  1. Ask for -tp 2. What does the engine say, and before or after reading the weights?
  2. With PP=2, stage 0 and stage 1 hold the same block ids. Why can one stage never run out of
     blocks while the other still has room? What would change if each stage kept its own
     block table, as the seed describes?
"""

import importlib.util
import os

from minipaged import LLMEngine, SamplingParams  # before numpy: it sets up numpy's thread pools
import numpy as np

from minipaged.engine.parallel import executor as executor_module
from minipaged.model.sharding import stage_layers

MODEL = os.environ.get("MINIPAGED_TUTORIAL_MODEL", "smollm2-135m-instruct")
PROMPT = "A block table maps each logical block of a sequence to a physical block, so that"
PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
COMMON = dict(device="cpu", num_blocks=64, block_size=16, swap_space=0.01)


def run(engine: LLMEngine):
    """One request to the end; returns its tokens, text and the block table of its sequence."""
    engine.add_request("r", PROMPT, PARAMS)
    table = None
    while engine.has_unfinished_requests():
        group = engine.groups.get("r")
        if group is not None and group.seqs[0].seq_id in engine.block_manager.tables:
            table = list(engine.block_manager.tables[group.seqs[0].seq_id].block_ids)
        for out in engine.step():
            if out.finished:
                return out.outputs[0].token_ids, out.outputs[0].text, table


print("1. The same engine three ways")
engines = {"one worker": LLMEngine(MODEL, **COMMON),
           "TP=3": LLMEngine(MODEL, **COMMON, tensor_parallel_size=3),
           "PP=2": LLMEngine(MODEL, **COMMON, pipeline_parallel_size=2)}
c = engines["one worker"].model_config
print(f"  the model: {c.num_hidden_layers} layers, {c.num_attention_heads} query heads, "
      f"{c.num_key_value_heads} KV heads, MLP {c.intermediate_size}")
for name, engine in engines.items():
    print(f"  {name}:")
    for w in engine.executor.workers:
        layer = w.model.layers[0]
        print(f"    worker {w.shard.name}: {w.config.num_hidden_layers:>2} layers, "
              f"{w.config.num_attention_heads} q / {w.config.num_key_value_heads} KV heads, qkv {layer.qkv.shape}, "
              f"o {layer.o.shape}, down {layer.down.shape}; pool {w.cache.kv_cache.shape} = "
              f"{w.pool_bytes() / 2**20:.2f} MiB; embeds tokens: {'yes' if w.shard.is_first_stage else 'no'}, "
              f"LM head: {'yes' if w.model.lm_head is not None else 'no'}")
one_pool = engines["one worker"].executor.pool_bytes()[0]
assert engines["TP=3"].executor.pool_bytes() == [one_pool // 3] * 3
assert sum(engines["PP=2"].executor.pool_bytes()) == one_pool
print(f"  every split: {engines['TP=3'].block_manager.num_blocks} blocks, one block manager, "
      "one block table per sequence")

print("\n2. One request, one block table, different heads in every pool")
results = {name: run(engine) for name, engine in engines.items()}
table = results["one worker"][2]
assert all(r[2] == table for r in results.values()), "the driver chose other blocks"
block = table[1]
print(f"  the request's block table (the same in all three runs): {table}; look at block {block}")
one = engines["one worker"].cache.kv_cache          # (layers, 2, blocks, kv_heads, block_size, head_dim)
print(f"  one worker, layer 0, K of block {block}: {one[0, 0, block].shape} (all {c.num_key_value_heads} KV heads)")
for w in engines["TP=3"].executor.workers:
    mine = w.cache.kv_cache[0, 0, block]                                # (1, block_size, head_dim)
    r = w.shard.tp_rank
    err = float(np.max(np.abs(mine[0] - one[0, 0, block, r])))
    print(f"    TP rank {r}: {mine.shape}, equal to the one-worker pool's head {r} (largest difference {err:.1e}); "
          f"first values {np.round(mine[0, 0, :3], 3)}")
    assert err < 1e-4
stage1 = engines["PP=2"].executor.stages[1][0]
layers = stage_layers(c.num_hidden_layers, 2, 1)                        # stage 1's layers
err = float(np.max(np.abs(stage1.cache.kv_cache[:, :, block] - one[layers.start:, :, block])))
print(f"    PP stage 1: its layer 0 is the model's layer {layers.start}; block {block} equals the one-worker "
      f"pool's layers {layers.start}..{layers.stop - 1} (largest difference {err:.1e})")
assert err < 1e-4

print("\n3. What a step costs the workers: all-reduces")
counts = []


def counted(run, box):
    """Pass a worker's forward pass through, counting its stops (each one all-reduce)."""
    try:
        value = next(run)
    except StopIteration as done:
        return done.value
    while True:
        box[0] += 1
        total = yield value
        try:
            value = run.send(total)
        except StopIteration as done:
            return done.value


def counting_lock_step(runs):
    boxes = [[0] for _ in runs]             # one counter per rank
    counts.extend(boxes)
    return original([counted(run, box) for run, box in zip(runs, boxes)])


original = executor_module.run_in_lock_step
executor_module.run_in_lock_step = counting_lock_step
engines["TP=3"].add_request("count", PROMPT, SamplingParams(max_tokens=1))
engines["TP=3"].step()
executor_module.run_in_lock_step = original
print(f"  one step, TP=3: each rank stopped {counts[0][0]} times = 2 x {c.num_hidden_layers} layers "
      "(after o_proj, after down_proj); each time the three partial sums were added")
assert [n[0] for n in counts] == [2 * c.num_hidden_layers] * 3
same = {name: r[0] == results["one worker"][0] for name, r in results.items()}
print(f"  the same tokens as one worker: {same}")
print(f"  text: {results['TP=3'][1]!r}")
assert all(same.values())

if importlib.util.find_spec("ray") is not None:
    print("\n4. Two stages as two Ray actor processes")
    ray_engine = LLMEngine(MODEL, **COMMON, pipeline_parallel_size=2, distributed_executor_backend="ray")
    tokens, _, _ = run(ray_engine)
    print(f"  worker processes {ray_engine.executor.pids} (this one is {os.getpid()}); "
          f"pools {[b // 2**20 for b in ray_engine.executor.pool_bytes()]} MiB")
    print(f"  the same tokens over Ray: {tokens == results['one worker'][0]}")
    assert tokens == results["one worker"][0]
    ray_engine.shutdown()
else:
    print("\n4. (Ray is not installed: pip install 'minipaged[distributed]' to run the stages as actors)")

print("""
Done: the block manager planned once, for every worker; each worker's pool held only its heads
or its layers, at the same block ids, and the tokens did not change.
Exercises:
  1. Ask for -tp 2. What does the engine say, and before or after reading the weights?
  2. With PP=2, stage 0 and stage 1 hold the same block ids. Why can one stage never run out of
     blocks while the other still has room? What would change if each stage kept its own
     block table, as the seed describes?""")
