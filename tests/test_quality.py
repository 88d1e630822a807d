"""``bench quality`` (minipaged/tools/quality.py) on a text the user gives: its perplexity against
the dense float64 reference's over the same windows, and its bad files refused before loading."""

import math
import subprocess
import sys

import numpy as np
import pytest

from minipaged.tools.quality import check_quality_args, run_quality

TEXT = ("The quick brown fox jumps over the lazy dog. Paging maps virtual pages onto physical frames,\n"
        "and a block table maps a sequence's tokens onto KV blocks.\n") * 3


def reference_perplexity(reference, token_ids: list[int], window: int) -> float:
    """exp(mean NLL) over windows of ``window`` tokens, each scored from scratch in float64."""
    nll, counted = 0.0, 0
    for start in range(0, len(token_ids), window):
        ids = token_ids[start:start + window]
        if len(ids) < 2:
            continue
        logits = reference.logits(ids)                                          # (L, vocab)
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))                     # (L, vocab)
        nll -= sum(logp[i - 1, ids[i]] for i in range(1, len(ids)))
        counted += len(ids) - 1
    return math.exp(nll / counted)


@pytest.fixture
def path(tmp_path):
    """TEXT in a UTF-8 file."""
    file = tmp_path / "text.txt"
    file.write_text(TEXT, encoding="utf-8")
    return file


def quality_cfg(**over) -> dict:
    return {"kv_cache_dtypes": "auto", "weight_formats": "float32", "num_tokens": 8192, "window": 48,
            "text_file": None, **over}


def test_a_text_file_is_scored_as_the_reference_scores_it(calm_model_dir, path):
    """The whole file (shorter than --num-tokens) in windows of 48: the engine's perplexity is the
    float64 reference's; no golden row for a model that is not the golden outputs' own."""
    from minipaged.model.config import LlamaConfig
    from minipaged.model.reference import DenseReference
    from minipaged.model.tokenizer import Tokenizer
    from minipaged.model.weights import load_checkpoint

    report = run_quality({"model": str(calm_model_dir), "device": "cpu", "num_blocks": 64},
                         quality_cfg(text_file=str(path)))
    row = report["rows"]["auto"]
    ids = Tokenizer.from_dir(calm_model_dir).encode(TEXT)
    assert report["text_tokens"] == len(ids) and row["tokens_scored"] == len(ids) - math.ceil(len(ids) / 48)
    reference = DenseReference(LlamaConfig.from_dir(calm_model_dir), load_checkpoint(calm_model_dir))
    assert row["perplexity"] == pytest.approx(reference_perplexity(reference, ids, 48), rel=1e-4)
    assert "golden_steps" not in row and str(path) in report["text"]


def test_num_tokens_takes_the_start_of_the_text(calm_model_dir, path):
    report = run_quality({"model": str(calm_model_dir), "device": "cpu", "num_blocks": 64},
                         quality_cfg(text_file=str(path), num_tokens=30, window=16))
    assert report["rows"]["auto"]["tokens_scored"] == 30 - 2 and report["rows"]["auto"]["windows"] == 2


@pytest.mark.parametrize("content,message", [
    (b"\xff\xfe not text", "not UTF-8 text"),
    (b"  \n\t", "the file holds no text"),
    (None, "no such file"),
])
def test_a_bad_text_file_is_refused_naming_the_problem(tmp_path, content, message):
    path = tmp_path / "text.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        check_quality_args(quality_cfg(text_file=str(path)))
    with pytest.raises(ValueError, match="a directory"):
        check_quality_args(quality_cfg(text_file=str(tmp_path)))


def test_the_cli_refuses_a_bad_text_file_before_loading(tiny_model_dir, tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\xe9".encode("latin-1"))
    for args, message in ((["quality", "--text-file", str(path)], "not UTF-8 text"),
                          (["throughput", "--text-file", str(path)], "--text-file does not apply to the throughput")):
        result = subprocess.run([sys.executable, "-m", "minipaged", "bench", *args, "--model", str(tiny_model_dir),
                                 "--device", "cpu"], capture_output=True, text=True, timeout=120)
        assert result.returncode == 1 and message in result.stderr and "Traceback" not in result.stderr


def test_a_window_longer_than_the_context_is_cut_to_the_longest_prompt(calm_model_dir, path):
    """--window at max_model_len: each window is a prompt, which must leave room for one token."""
    report = run_quality({"model": str(calm_model_dir), "device": "cpu", "num_blocks": 64, "max_model_len": 32},
                         quality_cfg(text_file=str(path), num_tokens=62, window=32))
    row = report["rows"]["auto"]
    assert row["window"] == 31 and row["windows"] == 2 and row["tokens_scored"] == 62 - 2


def test_one_weight_format_other_than_float32_is_named_in_the_row(calm_model_dir, path):
    report = run_quality({"model": str(calm_model_dir), "device": "cpu", "num_blocks": 64},
                         quality_cfg(text_file=str(path), num_tokens=40, window=20, weight_formats="int8"))
    assert list(report["rows"]) == ["int8 / auto"] and report["rows"]["int8 / auto"]["weight_format"] == "int8"


def test_the_golden_model_is_known_by_its_fetch_marker_or_its_place(tmp_path, monkeypatch):
    """The registry's directory (its marker names the default model), reached through a symlink or
    copied elsewhere, gets the golden columns; another model's does not."""
    from minipaged.model.fetch import COMPLETE_MARKER, DEFAULT_MODEL, model_dir
    from minipaged.tools.quality import is_golden_model

    monkeypatch.setenv("MINIPAGED_HOME", str(tmp_path / "home"))
    fetched = model_dir(DEFAULT_MODEL)
    fetched.mkdir(parents=True)
    (fetched / COMPLETE_MARKER).write_text('{"name": "%s"}\n' % DEFAULT_MODEL)
    (tmp_path / "link").symlink_to(fetched)
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / COMPLETE_MARKER).write_text((fetched / COMPLETE_MARKER).read_text())
    other = tmp_path / "other"
    other.mkdir()
    (other / COMPLETE_MARKER).write_text('{"name": "another-model"}\n')
    assert is_golden_model(fetched) and is_golden_model(tmp_path / "link") and is_golden_model(copy)
    assert not is_golden_model(other) and not is_golden_model(tmp_path)   # no marker, another place
    (fetched / COMPLETE_MARKER).unlink()
    assert is_golden_model(tmp_path / "link")                              # no marker, the same place


def test_a_context_too_short_for_a_window_is_refused(calm_model_dir, path):
    with pytest.raises(ValueError, match="--max-model-len 2 leaves a window of 1 prompt token"):
        run_quality({"model": str(calm_model_dir), "device": "cpu", "num_blocks": 64, "max_model_len": 2},
                    quality_cfg(text_file=str(path), num_tokens=30, window=16))


def test_a_text_file_that_is_not_a_regular_file_or_carries_a_bom(tmp_path):
    import os

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        check_quality_args(quality_cfg(text_file=str(fifo)))
    from minipaged.tools.quality import read_text_file

    (tmp_path / "bom.txt").write_bytes("\ufeffHello".encode("utf-8"))
    assert read_text_file(str(tmp_path / "bom.txt")) == "Hello"
