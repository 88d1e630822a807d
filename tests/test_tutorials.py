"""The tutorials run from start to finish and still teach what they say.

Each tutorial asserts its own key facts, so a zero exit code already means the
engine behaves as the narrative claims; the lines checked here make sure the
lesson's main points were actually printed. Every tutorial in tutorials/ must
have a test here and must end with exercises for the reader.
"""

import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

from minipaged.kernels.fast.packed_gemm import find_mkl_library

# oneMKL can run here (the tutorials then show it beside our kernels): its wheel, on Linux x86-64
MKL_HERE = find_mkl_library() is not None and sys.platform.startswith("linux") and platform.machine() == "x86_64"

ROOT = Path(__file__).resolve().parent.parent
TUTORIALS = sorted(p.name for p in (ROOT / "tutorials").glob("[0-9][0-9]_*.py"))


def run_tutorial(name: str, timeout: float = 300) -> str:
    env = dict(os.environ, MINIPAGED_LOG_LEVEL="WARNING")
    result = subprocess.run([sys.executable, f"tutorials/{name}"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (
        f"{name} exited with {result.returncode}\n--- stdout ---\n{result.stdout[-3000:]}"
        f"\n--- stderr ---\n{result.stderr[-3000:]}")
    assert "\nExercises:\n" in result.stdout, f"{name} prints no exercises"
    return result.stdout


def test_every_tutorial_is_tested_and_listed():
    tested = {name[len("test_"):len("test_t00")] for name in globals() if name.startswith("test_t")}
    readme = (ROOT / "tutorials" / "README.md").read_text()
    assert len(TUTORIALS) >= 13, TUTORIALS
    for name in TUTORIALS:
        assert f"t{name[:2]}" in tested, f"no test for tutorials/{name}"
        assert f"`{name}`" in readme, f"tutorials/README.md does not list {name}"


@pytest.mark.slow
def test_t00_quickstart():
    out = run_tutorial("00_quickstart.py")
    assert "inside a batch: identical to seed 1 alone = True" in out
    assert "finish_reason=stop, stop_reason=" in out
    assert "<|im_start|>assistant" in out                 # the chat template was applied
    assert "joined == the non-streamed greedy text: True" in out


@pytest.mark.slow
def test_t01_two_phases_and_the_kv_cache():
    out = run_tutorial("01_two_phases_and_the_kv_cache.py")
    assert "prefill step: 256 prompt tokens in, 1 token sampled" in out
    assert "LLaMA-13B in fp16: 2 x 40 x 40 x 128 x 2 = 819,200 bytes per token (800 KiB)" in out
    assert "KV space, 30% of the card: 12.00 GB -> 14,648 tokens -> 7 sequences of 2048 tokens" in out
    assert "94,371,840 bytes / (128 blocks x 16 slots) = 46,080 bytes per token" in out
    assert "in float16 (the GPU default): 23,040 bytes per token (22.5 KiB)" in out


@pytest.mark.slow
def test_t02_fragmentation():
    out = run_tutorial("02_fragmentation.py")
    assert "contiguous, reserve max_model_len, after step 3: running ['C', 'B'], waiting ['A', 'D', 'E', 'F']" in out
    assert "D needs 10 contiguous blocks; 10 blocks are free, in runs of 4 (blocks 0-3), 6 (blocks 18-23)" in out
    assert "so 40 free slots are stranded (external fragmentation) and D waits" in out
    assert "paging finished the trace in 33 steps, against 46 and 52" in out
    assert "identical outputs for all 6 requests: True" in out


@pytest.mark.slow
def test_t03_blocks_and_block_tables():
    out = run_tutorial("03_blocks_and_block_tables.py")
    assert "request A: 7 tokens -> logical blocks 0..1 live in physical blocks [0, 1], fills [4, 3]" in out
    assert "'brought'  new block needed: True" in out
    assert "-> physical block 5 -> slot 20" in out
    assert "caught: device block" in out
    assert "used 0, free 8 of 8" in out
    # the walk-through drawn from the real engine: A's page table and its first block's tokens
    assert "A: 0->0(4) 1->1(3)" in out and "[  0] Four  |␣score|␣and  |␣seven  <- A" in out
    assert "both finished: 0 blocks in use" in out


def test_t04_paged_attention_kernel():
    out = run_tutorial("04_paged_attention_kernel.py")
    assert "query_start_loc [0, 6, 7]" in out
    assert "max |kernel - spec|" in out and "max |kernel - dense|" in out
    assert "D's query heads that changed: [2, 3]" in out
    assert "_attend is " in out and "for j in range(first // block_size, pos // block_size + 1):" in out
    assert "the fast tier on the same batch: max |fast - plain|" in out
    assert "paged_prefill on the mixed batch: max |cuda - spec|" in out
    assert "3 partitions of 512 (split-K) + reduce" in out


@pytest.mark.slow
def test_t05_continuous_batching():
    out = run_tutorial("05_continuous_batching.py")
    assert "steps mixing a prefill with decodes: [" in out
    assert "static batching:     23 steps" in out
    assert "same greedy tokens either way: True" in out


@pytest.mark.slow
def test_t06_parallel_sampling():
    out = run_tutorial("06_parallel_sampling.py")
    # three tables mapping the same blocks, and the prompt computed once
    assert re.search(r"ref counts \[3(, 3)*\]; prompt tokens computed: (\d+), not 3 x \2\n", out)
    assert "copy-on-write plan blocks_to_copy [(" in out
    assert out.count("== n=1 with seed derive_seed(") == 3 and ": False" not in out
    assert "(kv_blocks_unshared_peak)" in out


@pytest.mark.slow
def test_t07_beam_search():
    out = run_tutorial("07_beam_search.py")
    assert "forked {" in out and "pruned [" in out
    assert "the same 4 ranked beams as LLM.beam_search: True" in out
    assert "peak blocks: " in out


@pytest.mark.slow
def test_t08_out_of_memory():
    out = run_tutorial("08_out_of_memory.py")
    assert "PREEMPTED" in out and "came back and re-prefilled" in out
    assert "  out [(" in out and "  in [(" in out        # the swap plans were shown
    assert "before swap-out: True" in out and "before swap-out: False" not in out
    assert "-> recompute" in out and "-> swap" in out   # auto used both, by the rule
    assert out.count("same in all three as the big pool: True") == 3


@pytest.mark.slow
def test_t09_prefix_caching():
    out = run_tutorial("09_prefix_caching.py")
    assert "found in the cache" in out and "blocks revived from the LRU" in out
    assert "outputs identical with caching off: True" in out
    assert "the engine without caching really peaked at" in out


@pytest.mark.slow
def test_t10_chunked_prefill():
    out = run_tutorial("10_chunked_prefill.py")
    assert "its first token came at step" in out
    assert "largest step: 66 tokens without chunking, 16 with" in out
    assert "outputs with and without chunking identical: True" in out
    assert "the decodes' worst wait for a token" in out and "outputs identical: True" in out


@pytest.mark.slow
def test_t11_choosing_a_block_size():
    out = run_tutorial("11_choosing_a_block_size.py", timeout=600)
    assert "block_size 16: empty slots [7, 14, 3, 12, 14, 9, 4, 7]  total  70" in out
    assert "block_size  4: entries per sequence [15, 13, 12, 9, 9, 6, 7, 7]  (longest 15); widest block_tables row 15" in out
    assert "block sizes that had to preempt or make requests wait: [32, 64]" in out
    assert "the greedy outputs are identical for all five block sizes: True" in out
    assert "block_size 64: 114 shared tokens; each later request found  64 =  1 x 64 in the cache" in out


@pytest.mark.slow
def test_t12_production_knobs():
    out = run_tutorial("12_production_knobs.py")
    assert "exit code 1, stderr: 'error: block_size must be a power of two between 1 and 256, got 12'" in out
    assert "CPU: kv_cache_space=0.25 GiB -> 364 blocks (5824 token slots); swap_space=0.125 GiB -> 182 CPU blocks" in out
    assert "first token at step [1, 1, 1, 9, 9, 9, 17, 17]" in out
    assert "swap, swap_space 2 blocks       80       1    0      1          0        2           384" in out
    assert "only 99 usable blocks" in out


def test_readme_states_the_core_engine_line_count():
    readme = (ROOT / "README.md").read_text()
    stated = int(re.search(r"Together they are (\d+) lines", readme).group(1))
    core = ["sequence", "memory/block_allocator", "memory/block_table", "memory/block_manager",
            "memory/prefix_cache", "scheduler/scheduler", "engine/input_processor", "engine/llm_engine"]
    actual = sum(len((ROOT / "minipaged" / f"{name}.py").read_text().splitlines()) for name in core)
    assert stated == actual, f"README says {stated} lines, the core engine has {actual}"



def test_readme_states_the_kernel_tiers_sizes():
    """The plain tier's lines, the fast tier's lines and modules, as the README says; no module of
    the fast tier over 400 lines (one concept each)."""
    readme = (ROOT / "README.md").read_text()
    plain = int(re.search(r"`kernels/simple.py`, is (\d+) lines", readme).group(1))
    fast_lines, fast_modules = (int(n) for n in re.search(r"`kernels/fast/`, is (\d+) lines in (\d+)\s+modules",
                                                          readme).groups())
    assert plain == len((ROOT / "kernels" / "simple.py").read_text().splitlines())
    modules = sorted((ROOT / "kernels" / "fast").glob("*.py"))
    sizes = {path.name: len(path.read_text().splitlines()) for path in modules}
    assert (fast_lines, fast_modules) == (sum(sizes.values()), len(modules)), sizes
    assert max(sizes.values()) <= 400, sizes


@pytest.mark.slow
def test_t13_serving_many_clients():
    out = run_tutorial("13_serving_many_clients.py")
    assert re.search(r"at most [2-4] requests held blocks at the same moment; \d+ engine steps served more "
                     r"than one client", out)
    assert re.search(r"the highest ref count seen: [2-4] \(the system prompt's first blocks", out)
    assert re.search(r"now 0 blocks are used and \d+ are cached", out)
    assert 'vllm:prefix_cache_hits_total{model_name="smollm2-135m-instruct"}' in out
    assert "aborted 0 request(s) in flight; KV blocks in use: 0" in out


@pytest.mark.slow
def test_t14_the_roofline():
    out = run_tutorial("14_the_roofline.py")
    assert "every weight once: 134,479,872 float32 parameters in the layers' matrices and the LM head = 537.9 MB" in out
    assert re.search(r"decode B=1 +544\.1 MB +5\.9 MB +0\.28 +0\.51 .* bandwidth-bound", out)
    assert re.search(r"prefill 256 +561\.7 MB .* compute-bound", out)
    assert "8 sequences share the weights but each reads its own KV: 3.79 FLOP/byte, 7.4x, not 8x" in out
    assert "measured: prefilled 4 x 128 tokens in" in out and "measured: prefill 256:" in out
    assert re.search(r"\n +B=1 +\d+ +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+ ", out) and re.search(r"\n +T=256 +[\d.]+ ", out)
    assert "serial: the bound if attention's K/V reading cannot hide under the products' arithmetic" in out
    assert "the LM head is tied: the embedding matrix itself, read once per step (49,152 x 576)" in out
    assert re.search(r"\n +B=2: [\d.]+x the bound of B=1, .*\(linear: (panels|skinny kernel), step 4\)", out)
    assert "the weight: 3072 x 576 float32 (7.1 MB)" in out
    assert re.search(r"\n +1 +1\.00x +[\d.]+x +[\d.]+x +panels\n +2 +[\d.]+x +[\d.]+x +[\d.]+x +panels\n", out)
    assert re.search(r"\n +64 +[\d.]+x +[\d.]+x +[\d.]+x +panels\n +128 +[\d.]+x +[\d.]+x +[\d.]+x +panels\n"
                     r" +256 +[\d.]+x +[\d.]+x +[\d.]+x +BLAS gemm\n", out)
    assert re.search(r"the panels beat the skinny kernel at \d+ of 8 row counts", out)
    assert re.search(r"so linear runs the panels for 1\.\.\d+ rows, and BLAS's gemm for more", out)
    if not MKL_HERE:
        assert "oneMKL is not installed here" in out
    else:                                           # oneMKL's packed product beside the panels, by name
        assert re.search(r"\n +64 +[\d.]+x +[\d.]+x\n +with cpu_gemm='mkl' the engine packs every weight of 30 "
                         r"layers", out)
    assert "minipaged sets OPENBLAS_THREAD_TIMEOUT=16 (OpenBLAS's threads spin 2**16 cycles" in out
    assert re.search(r"for Numba's OpenMP pool, GOMP_SPINCOUNT=\d+ .* KMP_BLOCKTIME=\d+", out)
    assert "python -m minipaged bench roofline" in out


def test_t15_compressed_kv_cache():
    out = run_tutorial("15_compressed_kv_cache.py")
    assert "3.76x float32" in out and "4.00x float32" in out
    assert "bytes and scales identical" in out
    assert "perplexity" in out and "Done: one byte a value" in out
    assert "budget 64 tokens = 4 blocks a head" in out and "'#': read" in out
    assert "on a GPU: int8 1.88x the float16 blocks" in out and "on a GPU: fp8 2.00x the float16 blocks" in out
    assert "paged_decode_f32 over int8 blocks" in out


def test_t16_speculative_decoding():
    out = run_tutorial("16_speculative_decoding.py")
    assert "<- the draft" in out and "table before the pass:" in out and "table after the rollback:" in out
    assert "drafts stood, then the model's own next token" in out
    assert "identical tokens: True" in out and "the target as its own draft" in out
    assert "Done: drafts cost a few query rows" in out


def test_t23_sliding_window_paging():
    out = run_tutorial("23_sliding_window_paging.py")
    assert "layer windows (32, 32, 32)" in out and "table [- - - -" in out
    assert "at most 9 blocks held (32 // 4 + 2), against 45 without the release" in out
    assert "the same tokens with and without the release: True" in out and "first 24 tokens equal: True" in out
    assert "request b, the same 60 tokens: 56 tokens found in the cache" in out
    assert "may free nothing: sliding_window for paging = 0" in out and "80 tokens held 20 blocks" in out


@pytest.mark.slow
def test_t24_structured_outputs():
    out = run_tutorial("24_structured_outputs.py")
    assert "step 0:      1 of 49152 tokens allowed" in out               # '{' is the only way to start
    assert "json   -> '{" in out and "finish_reason=stop" in out
    assert "the choice ended the request itself: 1 token(s), no end-of-sequence token" in out
    assert "-> call get_weather(" in out or "-> call add(" in out
    assert "tenant-b:   0 of" in out and "JSON / free =" in out


def test_t25_bytes_per_weight():
    out = run_tutorial("25_bytes_per_weight.py")
    assert "134,479,872 weights" in out and "float32:   537.9 MB a step" in out and "gguf:    96.4 MB a step" in out
    assert "d * q + m is what llama.cpp's own dequantizer gives: True" in out
    assert out.count("1, 8 and 16 rows agree with x @ dequantize().T: True") == 3
    assert "gguf computes on the very weights the float32 directory holds: the same tokens, True" in out
    assert re.search(r"int8: +[\d.]+ MB held, +[\d.]+ ms a token", out)
    assert re.search(r"gguf_a8 agrees with gguf on \d+ of 48 tokens", out)
    assert out.count("equal to round_activations(x) @ dequantize().T: True") == 3


def test_t17_demand_paging():
    out = run_tutorial("17_demand_paging.py")
    assert "gives up 1 block(s)" in out and "(present bits " in out and "0)" in out
    assert "only the missing entries come back" in out and "every entry present: it runs again" in out
    assert "the same tokens: True" in out


def test_t18_tensor_and_pipeline_parallelism():
    out = run_tutorial("18_tensor_and_pipeline_parallelism.py")
    assert "worker tp2/pp0: 30 layers, 3 q / 1 KV heads" in out and "pool (30, 2, 64, 1, 16, 64)" in out
    assert "equal to the one-worker pool's head 2" in out and "its layer 0 is the model's layer 15" in out
    assert "each rank stopped 60 times = 2 x 30 layers" in out
    assert "{'one worker': True, 'TP=3': True, 'PP=2': True}" in out
    assert "the same tokens over Ray: True" in out


def test_t19_one_kernel_per_step():
    out = run_tutorial("19_one_kernel_per_step.py")
    assert "100,000 tasks: each run 1..1 time(s); the done counter reads 100,000" in out
    assert re.search(r"iteration 0 ran [\d,]+ tasks, [\d,]+ of them from its own range \[0, ", out)
    assert ("30 layers, 10 phases each (one more for layer 0's first norm, one for the LM head): 302 phases "
            "in one parallel region") in out
    assert "the same logits, bit for bit: True; the same K/V written: True" in out
    assert re.search(r"iterations on \d+ threads: .* The same logits: True", out)
    assert re.search(r"layer by layer: [\d.]+ ms a token; one kernel: [\d.]+ ms \([\d.]+x\); the same tokens: True", out)


def test_t20_choosing_an_engine_by_timing():
    out = run_tutorial("20_choosing_an_engine_by_timing.py")
    assert "    1 rows: single-stream decode" in out and "  129 rows: prefill" in out
    if MKL_HERE:     # oneMKL installed: timed, kept, read back
        assert re.search(r"single-stream decode +1x1, 1x1, 1x1, 1x1 +[\d.]+ +[\d.]+   (numba|mkl)", out)
        assert re.search(r"prefill +prefill +[\d.]+ +[\d.]+   (numba|mkl)", out)
        assert "kept in " in out and "a new CPU, library or kernel is timed afresh" in out
        assert "cpu_gemm='mkl'    " in out
    else:
        assert "oneMKL is not installed here" in out
    assert re.search(r"cpu_gemm='numba'  (single-stream decode|batched decode|prefill) numba x \d+", out)
    assert "the same greedy tokens from every engine:" in out


def test_t21_operating_the_server():
    out = run_tutorial("21_operating_the_server.py")
    assert re.search(r"2\. A [\d.]+ MB body: 413 in [\d.]+ s", out)
    assert "3. A 750,000-character prompt (a 0.75 MB body, under the limit): 400, before tokenizing:" in out
    assert "the prompt has 750000 characters" in out and "at most 81 characters" in out
    assert re.search(r"100,000 characters, under the bound: tokenized .*, then 400:\n.*the prompt has \d+ tokens", out)
    assert re.search(r"4\. A slow-loris connection .* after [\d.]+ s the server sent 'HTTP/1.1 408 Request Timeout'", out)
    assert re.search(r"/health 200, \d+ requests running", out)
    assert "SIGTERM (a supervisor stopping a healthy server): exit 0" in out
    assert "the request got EngineDeadError" in out and "step timeout of 1 s" in out
    assert "health(): an engine step has run for" in out or "health(): the engine loop has stopped" in out
    assert "the dead-engine listeners heard it once: EngineHungError" in out



@pytest.mark.slow
def test_t22_from_plain_to_fast_kernels():
    out = run_tutorial("22_from_plain_to_fast_kernels.py")
    assert re.search(r"kernels='simple' +SimpleOps", out) and re.search(r"kernels='fast' +FastOps", out)
    assert "the same tokens: True; the fast tier" in out
    assert re.search(r"  registers +[\d.]+ ms +[\d.]+x +named vector registers", out)
    assert re.search(r"1 row\(s\): BLAS +[\d.]+ us, skinny +[\d.]+ us, panels +[\d.]+ us", out)
    assert "(tutorial 19)" in out and "the same tokens" in out
    assert "5. What each trick bought, here" in out
