"""The contiguous baseline, the slot accounting, the memory benchmark and the pictures."""

import json
import subprocess
import sys
import xml.dom.minidom
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged import LLM, LLMEngine, SamplingParams
from minipaged.config import SchedulerConfig
from minipaged.memory.contiguous_allocator import ContiguousBlockManager
from minipaged.memory.fragmentation import measure, summarize
from minipaged.scheduler.scheduler import Scheduler
from minipaged.sequence import Sequence, SequenceGroup, SequenceStatus
from minipaged.tools.viz import engine_snapshot, render_svg, render_text

ROOT = Path(__file__).parents[1]


def prompts(n, seed):
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(3, 259, size=int(rng.integers(5, 60))).tolist()} for _ in range(n)]


def test_both_allocators_give_the_same_tokens(tiny_model_dir):
    batch = prompts(10, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outputs = {}
    for allocator in ("paged", "contiguous"):
        llm = LLM(str(tiny_model_dir), device="cpu", block_size=4, num_blocks=120, max_model_len=128,
                  swap_space=0.002, kv_allocator=allocator, track_fragmentation=True)
        outputs[allocator] = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
        stats = llm.get_stats()
        llm.llm_engine.block_manager.check_invariants()
        assert stats["kv_blocks_used"] == 0
        outputs[allocator + " stats"] = stats
    assert outputs["paged"] == outputs["contiguous"]
    paged, contiguous = outputs["paged stats"], outputs["contiguous stats"]
    assert contiguous["num_preemptions"] == 0                     # growth was reserved up front
    assert paged["fragmentation"]["utilization"] > 0.85 > 0.5 > contiguous["fragmentation"]["utilization"]
    assert paged["max_concurrent_requests"] > contiguous["max_concurrent_requests"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 30)), min_size=1, max_size=10),
       st.integers(12, 40), st.sampled_from(["max_tokens", "max_model_len"]), st.sampled_from([1, 4]))
def test_contiguous_runs_never_overlap_and_everyone_finishes(requests, num_blocks, reserve, block_size):
    max_model_len = 40
    manager = ContiguousBlockManager(num_blocks, block_size, max_model_len, reserve=reserve)
    scheduler = Scheduler(SchedulerConfig(max_model_len, max_num_seqs=4, max_num_batched_tokens=64), manager)
    groups = []
    for i, (prompt_len, max_tokens) in enumerate(requests):
        group = SequenceGroup(str(i), [Sequence(i, [1] * prompt_len)], SamplingParams(max_tokens=max_tokens))
        seq = group.seqs[0]
        if -(-manager.reservation_tokens(seq, max_tokens) // block_size) > num_blocks:
            continue  # the engine refuses it at the door
        groups.append(group)
        scheduler.add_seq_group(group)
    admitted = []
    for _ in range(2000):
        if not scheduler.has_unfinished_seqs():
            break
        plan = scheduler.schedule()
        slots = measure(manager, scheduler, max_model_len)
        assert slots.used + slots.reserved + slots.internal == slots.allocated
        assert 0 <= slots.external <= slots.free
        assert not plan.preempted
        for item in plan.scheduled:
            if item.group.request_id not in admitted:
                admitted.append(item.group.request_id)
            item.seq.num_computed_tokens += item.num_new_tokens
            item.seq.output_token_ids.append(1)
            if (item.seq.num_output_tokens >= item.group.sampling_params.max_tokens
                    or item.seq.num_tokens >= max_model_len):
                item.seq.status = SequenceStatus.FINISHED_LENGTH
        scheduler.free_finished()
        manager.check_invariants()
    assert not scheduler.has_unfinished_seqs()
    assert admitted == sorted(admitted, key=int)                      # FCFS
    assert manager.num_free_blocks == num_blocks


def test_slot_accounting_on_a_known_state(tiny_model_dir):
    engine = LLMEngine(str(tiny_model_dir), device="cpu", block_size=4, num_blocks=40, max_model_len=64,
                       swap_space=0.002, kv_allocator="contiguous", contiguous_reserve="max_model_len")
    engine.add_request("a", list(range(3, 13)), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    engine.step()   # prefill 10 tokens (computed), one sampled: the run reserves 64 slots = 16 blocks
    slots = measure(engine.block_manager, engine.scheduler, 64)
    assert slots.allocated == 64 and slots.used == 10
    assert slots.reserved == 15 - 10          # it will hold at most 10 + 6 - 1 = 15 tokens
    assert slots.internal == 64 - 15          # the rest of max_model_len is never used
    paged = LLMEngine(str(tiny_model_dir), device="cpu", block_size=4, num_blocks=40, max_model_len=64,
                      swap_space=0.002)
    paged.add_request("a", list(range(3, 13)), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    paged.step()
    slots = measure(paged.block_manager, paged.scheduler, 64)
    assert (slots.allocated, slots.used, slots.reserved, slots.internal) == (12, 10, 2, 0)


def test_external_fragmentation_is_seen(tiny_model_dir):
    """Free blocks exist but no run is long enough: the head of the queue waits anyway."""
    engine = LLMEngine(str(tiny_model_dir), device="cpu", block_size=4, num_blocks=13, max_model_len=48,
                       swap_space=0.002, kv_allocator="contiguous", contiguous_reserve="max_tokens",
                       track_fragmentation=True)
    short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_request("a", list(range(3, 10)), short)                                        # 2 blocks
    engine.add_request("b", list(range(3, 10)), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))  # 7
    engine.add_request("c", list(range(3, 10)), short)                                        # 2
    engine.add_request("d", list(range(3, 20)), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))   # 6
    while engine.has_unfinished_requests():
        engine.step()
    assert any(h.external > 0 for h in engine.kv_history)
    assert summarize(engine.kv_history)["external_fraction_of_pool"] > 0


def test_memory_bench_writes_both_sections_and_a_plot(tiny_model_dir, tmp_path):
    pytest.importorskip("matplotlib")
    out, plot = tmp_path / "memory.json", tmp_path / "memory.png"
    done = subprocess.run([sys.executable, "-m", "minipaged", "bench", "memory", "--model", str(tiny_model_dir),
                           "--num-prompts", "12", "--max-prompt-len", "60", "--output-len", "40",
                           "--min-output-len", "8", "--num-blocks", "64", "--max-model-len", "128",
                           "--block-size", "4", "--swap-space", "0.002", "--log-stats-interval", "0",
                           "--out", str(out), "--plot", str(plot)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    for section in ("paged", "contiguous"):
        for key in ("utilization", "max_concurrent_requests", "throughput_tok_s", "reserved_fraction",
                    "internal_fraction", "external_fraction_of_pool"):
            assert key in report[section]
    assert report["paged"]["utilization"] > report["contiguous"]["utilization"]
    assert plot.stat().st_size > 10_000


def test_text_and_svg_pictures_from_engine_state(tiny_model_dir):
    engine = LLMEngine(str(tiny_model_dir), device="cpu", block_size=4, swap_space=0.002)
    engine.add_request("p", "hello there", SamplingParams(n=2, temperature=1.0, max_tokens=4, seed=1))
    engine.step()
    view = engine_snapshot(engine)
    text = render_text(view)
    assert "p.0: 0->" in text and "p.1: 0->" in text and "shared" in text    # forked samples share
    svg = render_svg(view, "forked samples")
    xml.dom.minidom.parseString(svg)                                         # well-formed
    assert svg.count("<line") == sum(len(t.entries) for t in view.tables)


def test_pictures_show_the_contiguous_reservation(tiny_model_dir):
    engine = LLMEngine(str(tiny_model_dir), device="cpu", block_size=4, num_blocks=32, kv_allocator="contiguous",
                       max_model_len=40)
    engine.add_request("A", {"prompt_token_ids": list(range(7))}, SamplingParams(max_tokens=4, temperature=0))
    engine.step()
    view = engine_snapshot(engine)
    seq = engine.groups["A"].seqs[0]
    reserved = [b.block_id for b in view.blocks if b.state == "reserved"]
    # the run is 40 slots = 10 blocks: 2 mapped by A's table, the other 8 held for its future tokens
    assert reserved == engine.block_manager.reserved_blocks(seq) and len(reserved) == 8
    assert "8 reserved" in render_text(view) and "reserved for A" in render_svg(view)
    assert engine.cache.num_cpu_blocks == 0    # it never preempts, so it gets no swap pool


def test_the_docs_figures_are_up_to_date(tmp_path):
    """docs/img/*.svg are drawn from real block-manager state by docs/make_figures.py."""
    done = subprocess.run([sys.executable, str(ROOT / "docs" / "make_figures.py")], capture_output=True,
                          text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "years |ago   |our   |father" in done.stdout
    assert "copy-on-write copies: [(1, 2)]" in done.stdout
    # the window's release holds window / block_size + 2 blocks; keeping them, one per 4 tokens
    assert "'released as they slide out (window 32)': 9, 'kept (full attention, or no release)': 45" in done.stdout
    for name in ("walkthrough.svg", "cow_fork.svg", "sliding_window.svg"):
        assert (ROOT / "docs" / "img" / name).read_text().startswith("<svg")


def test_generate_show_blocks(tiny_model_dir):
    done = subprocess.run([sys.executable, "-m", "minipaged", "generate", "abcdef", "--model", str(tiny_model_dir),
                           "--device", "cpu", "--max-tokens", "3", "--block-size", "4", "--show-blocks",
                           "--log-stats-interval", "0"], capture_output=True, timeout=300)
    out = done.stdout.decode(errors="replace")
    assert done.returncode == 0, done.stderr
    assert out.count("=== step") >= 3 and "page tables" in out and "0->" in out


@pytest.mark.parametrize("workload,extra,sections", [
    ("throughput", [], ["result"]),
    ("single-stream", [], ["result"]),
    ("prefill", ["--min-prompt-len", "20", "--max-prompt-len", "20"], ["result"]),
    ("parallel-sampling", [], ["result"]),
    ("beam", [], ["result"]),
    ("shared-prefix", ["--prefix-len", "40"], ["caching off", "caching on"]),
    ("long-prompts", ["--long-prompts", "2", "--long-prompt-len", "60", "--chunk-budget", "16"],
     ["chunked off", "chunked on"]),
])
def test_every_bench_workload_runs(tiny_model_dir, tmp_path, workload, extra, sections):
    out = tmp_path / "bench.json"
    sizes = ["--num-prompts", "3", "--output-len", "4"] if workload not in ("single-stream", "prefill") else []
    if workload in ("throughput", "parallel-sampling", "beam", "shared-prefix"):
        sizes += ["--min-prompt-len", "8", "--max-prompt-len", "30"]
    done = subprocess.run([sys.executable, "-m", "minipaged", "bench", workload, "--model", str(tiny_model_dir),
                           "--device", "cpu", "--swap-space", "0.002", "--log-stats-interval", "0",
                           "--out", str(out), *sizes, *extra], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    for section in sections:
        assert report[section]["generated_tokens"] > 0 and report[section]["elapsed_s"] > 0
    if workload == "shared-prefix":
        assert report["caching on"]["prefix_cache_hit_rate"] > 0 == report["caching off"]["prefix_cache_hit_rate"]
    if workload == "parallel-sampling" or workload == "beam":
        assert report["result"]["kv_blocks_unshared_peak"] > report["result"]["kv_blocks_peak"]
