"""Linear paths (kernels/linear_paths.py) and cpu_gemm="auto"'s timing of them (engine/linear_calibration.py).

"auto" must pick each kind of step's engine by what this machine measures, never by who made
its CPU: the timings are faked here where a test needs a given outcome (so that every outcome
is covered on any host), the real timing is run once on the tiny model, and the engine's
tokens are checked against the explicitly asked-for engine's.
"""

import dataclasses
import json

import numba
import numpy as np
import pytest

from minipaged import SamplingParams
from minipaged.engine import linear_calibration
from minipaged.engine.backend import Backend
from minipaged.engine.linear_calibration import CalibrationCache, choose, settle_linear_paths
from minipaged.kernels.fast import packed_gemm, persistent_decode
from minipaged.kernels.fast.ops import FastOps
from minipaged.kernels.fast.tuning import DEFAULT_TUNING
from minipaged.kernels.fast.linear_paths import DECODE_MAX_ROWS, PATHS, STEP_KINDS, LinearPaths, step_kind
from minipaged.model.config import LlamaConfig
from minipaged.model.weights import load_checkpoint
from tiny_model import make_llm, tiny_config, write_tiny_llama


def _mkl_or_none():
    try:
        return packed_gemm.load_packed_gemm("mkl", numba.get_num_threads())
    except ValueError:
        return None


GEMM = _mkl_or_none()
needs_mkl = pytest.mark.skipif(GEMM is None, reason="oneMKL is not installed (pip install 'minipaged[mkl]')")


def test_a_steps_kind_follows_from_its_rows():
    assert [step_kind(r) for r in (1, 2, DECODE_MAX_ROWS, DECODE_MAX_ROWS + 1)] == \
        ["single_decode", "batched_decode", "batched_decode", "prefill"]
    assert DECODE_MAX_ROWS == DEFAULT_TUNING.panel_max_rows          # the panels' and the persistent kernel's limit
    paths = LinearPaths(batched_decode="mkl")
    assert [paths.for_rows(r) for r in (1, 2, 128, 129)] == ["numba", "mkl", "mkl", "numba"]
    assert paths.used() == ("numba", "mkl") and LinearPaths.every("mkl").used() == ("mkl",)
    assert paths.describe() == "single-stream decode numba, batched decode mkl, prefill numba"


def test_linear_paths_refuse_an_unknown_engine():
    with pytest.raises(ValueError, match=r"LinearPaths.prefill must be one of \('numba', 'mkl'\), got 'blas'"):
        LinearPaths(prefill="blas")
    with pytest.raises(ValueError, match="a step's kind is one of"):
        LinearPaths().for_kind("decode")
    with pytest.raises(dataclasses.FrozenInstanceError):
        LinearPaths().prefill = "mkl"


# medians: single 1 against 2 (one wild value sways neither), batched oneMKL 10% faster,
# prefill oneMKL 3% faster: within the margin, so a second copy of the weights is not worth it
SECONDS = {"single_decode": {"numba": [1.0, 1.0, 9.0], "mkl": [2.0, 2.0, 0.1]},
           "batched_decode": {"numba": [1.0] * 3, "mkl": [0.9] * 3},
           "prefill": {"numba": [1.0] * 3, "mkl": [0.97] * 3}}
CHOSEN = LinearPaths("numba", "mkl", "numba")


def test_each_kind_takes_the_engine_with_the_lower_median():
    assert choose(SECONDS) == CHOSEN
    assert choose(SECONDS, margin=0.0) == LinearPaths("numba", "mkl", "mkl")
    flipped = {kind: {"numba": t["mkl"], "mkl": t["numba"]} for kind, t in SECONDS.items()}
    assert choose(flipped) == LinearPaths("mkl", "numba", "numba")


class FakeGemm:
    num_threads = 2


def _auto_backend(gemm=None) -> Backend:
    """A CPU backend as select_backend makes it for cpu_gemm="auto" with oneMKL installed."""
    return Backend("cpu", FastOps(), np.dtype(np.float32), gemm or FakeGemm(), "auto", None)


# a model of which oneMKL packs some weights (gate_up and down: 2**18 elements or more); the tiny
# model's are all smaller, and a model that oneMKL would pack nothing of is never timed
WIDE = dict(hidden_size=512, intermediate_size=512)


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("wide-llama"), **WIDE)


def _cpuinfo(model: str, vendor: str):
    fields = {"model name": model, "vendor_id": vendor, "flags": "fpu avx2 avx512f"}
    return lambda name, cpuinfo="/proc/cpuinfo": fields.get(name)


def test_auto_measures_once_per_machine_and_model_shape(wide_model_dir, tmp_path, monkeypatch):
    cache = CalibrationCache(tmp_path / "linear_paths.json")
    measured = []

    def fake_measure(config, tensors, ops, gemm):
        measured.append(config.hidden_size)
        assert "model.embed_tokens.weight" in tensors and isinstance(ops, FastOps) and isinstance(gemm, FakeGemm)
        return SECONDS

    def settle(backend, config):
        return settle_linear_paths(backend, config, wide_model_dir, cache, fake_measure)

    monkeypatch.setattr(linear_calibration, "cpuinfo_field", _cpuinfo("Xeon", "GenuineIntel"))
    config = LlamaConfig.from_dict(tiny_config(**WIDE))
    settled = settle(_auto_backend(), config)
    assert settled.linear_paths == CHOSEN and isinstance(settled.gemm, FakeGemm)   # oneMKL kept: it has a kind
    assert settle(_auto_backend(), config).linear_paths == CHOSEN
    assert measured == [512]                                 # the second load read the file
    entry = next(iter(json.loads(cache.path.read_text())["entries"].values()))
    assert entry["paths"] == CHOSEN.as_dict() and entry["machine"]["cpu_model"] == "Xeon"
    assert entry["median_ms"]["batched_decode"] == {"numba": 1000.0, "mkl": 900.0}
    settle(_auto_backend(), LlamaConfig.from_dict(tiny_config(**WIDE, num_hidden_layers=2)))   # another shape
    monkeypatch.setattr(linear_calibration, "cpuinfo_field", _cpuinfo("EPYC", "AuthenticAMD"))
    assert settle(_auto_backend(), config).linear_paths == CHOSEN    # another machine: timed, same outcome
    assert measured == [512, 512, 512]
    # a model of which oneMKL would pack nothing: ours, untimed
    toy = settle(_auto_backend(), LlamaConfig.from_dict(tiny_config()))
    assert toy.linear_paths == LinearPaths.every("numba") and toy.gemm is None
    # what was asked for (or all there is) is never measured
    for asked in (LinearPaths.every("numba"), LinearPaths.every("mkl")):
        backend = dataclasses.replace(_auto_backend(), linear_paths=asked)
        assert settle(backend, config) is backend
    assert measured == [512, 512, 512]


def test_where_our_kernels_win_everything_onemkl_is_let_go(wide_model_dir, tmp_path):
    ours = {kind: {"numba": [1.0], "mkl": [2.0]} for kind in STEP_KINDS}
    settled = settle_linear_paths(_auto_backend(), LlamaConfig.from_dict(tiny_config(**WIDE)), wide_model_dir,
                                  CalibrationCache(tmp_path / "p.json"), lambda *a: ours)
    assert settled.linear_paths == LinearPaths.every("numba") and settled.gemm is None


def test_a_damaged_or_unwritable_cache_is_measured_again(wide_model_dir, tmp_path):
    config = LlamaConfig.from_dict(tiny_config(**WIDE))
    damaged = tmp_path / "damaged.json"
    damaged.write_text("{not json")
    settled = settle_linear_paths(_auto_backend(), config, wide_model_dir, CalibrationCache(damaged),
                                  lambda *a: SECONDS)
    assert settled.linear_paths == CHOSEN and json.loads(damaged.read_text())["format"] == linear_calibration.FORMAT
    blocked = tmp_path / "a-file"
    blocked.write_text("")                                   # its "directory" is a file: nothing can be kept
    settled = settle_linear_paths(_auto_backend(), config, wide_model_dir, CalibrationCache(blocked / "p.json"),
                                  lambda *a: SECONDS)
    assert settled.linear_paths == CHOSEN


def test_each_timed_case_is_a_step_of_its_kind():
    for kind, cases in linear_calibration.STEP_CASES.items():
        for seqs, tokens in cases:
            rows = linear_calibration.PREFILL_ROWS if seqs == "prefill" else seqs * tokens
            assert step_kind(rows) == kind


@needs_mkl
def test_the_timing_runs_every_kind_through_both_engines(wide_model_dir, monkeypatch):
    """Each engine really runs its own steps: oneMKL's packed products on its runs, the
    persistent kernel on our decode runs, and each kind's steps are of that kind."""
    calls = {"packed": 0, "persistent": 0}
    matmul, run = packed_gemm.PackedGemm.matmul, persistent_decode.run
    monkeypatch.setattr(packed_gemm.PackedGemm, "matmul",
                        lambda self, x, w: calls.__setitem__("packed", calls["packed"] + 1) or matmul(self, x, w))
    monkeypatch.setattr(persistent_decode, "run",
                        lambda *a: calls.__setitem__("persistent", calls["persistent"] + 1) or run(*a))
    config = LlamaConfig.from_dir(wide_model_dir)
    seconds = linear_calibration.measure(config, load_checkpoint(wide_model_dir), FastOps(), GEMM, rounds=2)
    assert set(seconds) == set(STEP_KINDS)
    for kind in STEP_KINDS:
        assert set(seconds[kind]) == set(PATHS)
        assert all(len(s) == 2 and min(s) > 0 for s in seconds[kind].values())
    assert choose(seconds).used()                            # a plan either way
    cases = linear_calibration.STEP_CASES
    decode_steps = 3 * (len(cases["single_decode"]) + len(cases["batched_decode"]))   # a warm round and 2
    assert calls["persistent"] == decode_steps               # every decode step on ours, none on oneMKL's
    # oneMKL's runs: its packed products for the steps of 8 rows and more (1 row stays skinny),
    # 2 of the layer's 4 weights packed (gate_up, down), in each layer, in 3 rounds
    packed_steps = 3 * (len(cases["batched_decode"]) + len(cases["prefill"]))
    assert calls["packed"] == packed_steps * 2 * config.num_hidden_layers


PROMPTS = [[(7 * i) % 250 + 3 for i in range(150)], [5, 6, 7], [8, 9]]   # 155 rows: a prefill step


def _generate(llm):
    """A prefill (155 rows), batched decodes, then a request decoding alone: every kind of step."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False) + llm.generate([[10, 11]], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@needs_mkl
@pytest.mark.parametrize("vendor", ["GenuineIntel", "AuthenticAMD"])
@pytest.mark.parametrize("timed", [LinearPaths.every("numba"), LinearPaths.every("mkl"),
                                   LinearPaths("numba", "numba", "mkl"), LinearPaths("mkl", "numba", "mkl")],
                         ids=["ours", "mkl", "prefill-mkl", "mixed"])
def test_auto_runs_what_this_machines_timing_chose(wide_model_dir, tmp_path, monkeypatch, vendor, timed):
    """With oneMKL installed, on Intel's CPU or another maker's, "auto" gives each kind of step
    the engine this machine's timing chose (a timing kept in the cache, faked here): where ours
    won the decodes, every decode step runs the persistent kernel. (Before issue 39, "auto" on
    an Intel CPU gave every step to oneMKL, whatever it measured, and the kernel never ran.)
    The tokens are those of our kernels asked for by name."""
    monkeypatch.setenv("MINIPAGED_HOME", str(tmp_path))
    monkeypatch.setattr(packed_gemm, "cpu_vendor", lambda *a: vendor)
    monkeypatch.setattr(linear_calibration, "cpuinfo_field", _cpuinfo(f"a CPU of {vendor}", vendor))
    config = LlamaConfig.from_dir(wide_model_dir)
    key = linear_calibration.entry_key(linear_calibration.machine_key(numba.get_num_threads()),
                                       linear_calibration.shape_key(config))
    CalibrationCache().put(key, {"paths": timed.as_dict()})
    monkeypatch.setattr(linear_calibration, "measure", lambda *a: pytest.fail("measured although cached"))
    runs, real = [], persistent_decode.run
    monkeypatch.setattr(persistent_decode, "run", lambda *a: runs.append(a[2].shape[0]) or real(*a))
    llm = make_llm(wide_model_dir, num_blocks=64)
    weights = llm.llm_engine.model.weights
    assert llm.llm_engine.backend.ops.linear_paths == timed and weights.tier_state.paths_made == timed.used()
    if "mkl" in timed.used():                   # oneMKL's own copies of the weights it packs
        assert isinstance(weights.layers[0].gate_up.mkl, packed_gemm.PackedWeight)
    assert (llm.llm_engine.backend.gemm is not None) == ("mkl" in timed.used())
    tokens = _generate(llm)
    steps = weights.tier_state.steps_by_path
    assert {kind for kind, _ in steps} == set(STEP_KINDS)
    assert all(path == timed.for_kind(kind) for kind, path in steps)
    decodes = sum(n for (kind, path), n in steps.items() if path == "numba" and kind != "prefill")
    assert len(runs) == decodes and (decodes > 0) == (timed.single_decode == "numba" or timed.batched_decode == "numba")
    assert tokens == _generate(make_llm(wide_model_dir, num_blocks=64, cpu_gemm="numba"))


def test_auto_on_an_intel_host_runs_the_persistent_kernel_where_ours_won(wide_model_dir, tmp_path, monkeypatch):
    """The issue-39 regression on any host, oneMKL installed or not (a stand-in loads): on an
    Intel CPU with oneMKL, where this machine's timing found our kernels faster at every kind,
    "auto" lets oneMKL go and every decode step runs the persistent kernel. (Before: every step
    oneMKL's, the kernel never ran.)"""
    monkeypatch.setenv("MINIPAGED_HOME", str(tmp_path))
    monkeypatch.setattr(packed_gemm, "cpu_vendor", lambda *a: "GenuineIntel")
    monkeypatch.setattr(linear_calibration, "cpuinfo_field", _cpuinfo("Xeon (Sapphire Rapids)", "GenuineIntel"))
    monkeypatch.setattr(packed_gemm, "load_packed_gemm", lambda choice, threads: FakeGemm())   # "installed"
    key = linear_calibration.entry_key(linear_calibration.machine_key(FakeGemm.num_threads),
                                       linear_calibration.shape_key(LlamaConfig.from_dir(wide_model_dir)))
    CalibrationCache().put(key, {"paths": LinearPaths.every("numba").as_dict()})
    runs, real = [], persistent_decode.run
    monkeypatch.setattr(persistent_decode, "run", lambda *a: runs.append(a[2].shape[0]) or real(*a))
    llm = make_llm(wide_model_dir, num_blocks=64)
    assert llm.llm_engine.backend.gemm is None and llm.llm_engine.backend.ops.linear_paths == LinearPaths.every("numba")
    _generate(llm)
    steps = llm.llm_engine.model.weights.tier_state.steps_by_path
    assert len(runs) == steps["single_decode", "numba"] + steps["batched_decode", "numba"] > 0


def test_a_draft_model_oneMKL_would_pack_nothing_runs_ours(tiny_model_dir):
    from minipaged.engine.spec_decode.draft_model import DraftModel
    backend = dataclasses.replace(_auto_backend(), linear_paths=LinearPaths.every("mkl"))
    draft = DraftModel(tiny_model_dir, LlamaConfig.from_dir(tiny_model_dir), backend, 128, 64)
    assert draft.model.ops.linear_paths == LinearPaths.every("numba")
    assert draft.model.weights.tier_state.persistent is not None


def test_without_onemkl_auto_is_our_kernels_unmeasured(wide_model_dir, monkeypatch):
    """A host without oneMKL (or not x86-64): nothing to time, every step ours, the persistent
    kernel on every decode step."""
    monkeypatch.setattr(packed_gemm, "find_mkl_library", lambda: None)
    monkeypatch.setattr(linear_calibration, "measure", lambda *a: pytest.fail("measured with one engine"))
    runs, real = [], persistent_decode.run
    monkeypatch.setattr(persistent_decode, "run", lambda *a: runs.append(a[2].shape[0]) or real(*a))
    llm = make_llm(wide_model_dir, num_blocks=64)
    assert llm.llm_engine.backend.ops.linear_paths == LinearPaths.every("numba") and llm.llm_engine.backend.gemm is None
    _generate(llm)
    steps = llm.llm_engine.model.weights.tier_state.steps_by_path
    assert len(runs) == steps["single_decode", "numba"] + steps["batched_decode", "numba"] > 0
