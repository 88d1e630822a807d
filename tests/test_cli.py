"""The command line, driven as a user would: a subprocess, flags, piped stdin."""

import json
import subprocess
import sys

import pytest

from minipaged import LLM, SamplingParams


def run_cli(*args, stdin=""):
    """Run the CLI; stdout/stderr decoded without newline translation (answers may hold '\\r')."""
    result = subprocess.run([sys.executable, "-m", "minipaged", *args], input=stdin.encode(),
                            capture_output=True, timeout=600)
    result.stdout, result.stderr = result.stdout.decode(), result.stderr.decode()
    return result


def test_chat_from_piped_stdin_keeps_history(tiny_model_dir):
    flags = ["--model", str(tiny_model_dir), "--device", "cpu", "--temperature", "0", "--max-tokens", "6"]
    result = run_cli("chat", *flags, stdin="hello\n/stats\nand again\n/reset\nhello\n")
    assert result.returncode == 0, result.stderr
    llm = LLM(str(tiny_model_dir), device="cpu")
    params = SamplingParams(temperature=0, max_tokens=6, repetition_penalty=1.1)   # chat's default penalty
    first = llm.chat([{"role": "user", "content": "hello"}], params, use_tqdm=False)[0].outputs[0].text
    second = llm.chat([{"role": "user", "content": "hello"}, {"role": "assistant", "content": first},
                       {"role": "user", "content": "and again"}], params, use_tqdm=False)[0].outputs[0].text
    out = result.stdout
    assert out.startswith(first + "\n")                       # streamed answer, then a newline
    stats_line, rest = out[len(first) + 1:].split("\n", 1)
    assert stats_line.startswith("running 0, waiting 0, KV blocks 0/")   # /stats
    # the second answer saw the first turn; after /reset the first answer comes again
    assert rest == second + "\n(conversation cleared)\n" + first + "\n"


def test_refused_message_keeps_the_history(tiny_model_dir):
    flags = ["--model", str(tiny_model_dir), "--device", "cpu", "--temperature", "0", "--max-tokens", "4",
             "--max-model-len", "64"]
    result = run_cli("chat", *flags, stdin="hi\n" + "x" * 80 + "\nagain\n")
    assert result.returncode == 0, result.stderr
    assert "error: the prompt has" in result.stderr and "max_model_len=64" in result.stderr
    llm = LLM(str(tiny_model_dir), device="cpu", max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=4, repetition_penalty=1.1)   # chat's default penalty
    first = llm.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False)[0].outputs[0].text
    third = llm.chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": first},
                      {"role": "user", "content": "again"}], params, use_tqdm=False)[0].outputs[0].text
    assert result.stdout == first + "\n" + third + "\n"


def test_generate_json(tiny_model_dir):
    result = run_cli("generate", "abc", "hello", "--model", str(tiny_model_dir), "--device", "cpu",
                     "--max-tokens", "5", "--ignore-eos", "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [r["prompt"] for r in rows] == ["abc", "hello"]
    for row in rows:
        (out,) = row["outputs"]
        assert len(out["token_ids"]) == 5 and out["finish_reason"] == "length"
        assert out["text"].startswith(row["prompt"])


def test_generate_n_and_beam_width(tiny_model_dir):
    flags = ["--model", str(tiny_model_dir), "--device", "cpu", "--max-tokens", "4", "--json"]
    rows = json.loads(run_cli("generate", "abc", "--n", "3", "--temperature", "1", *flags).stdout)
    assert len(rows[0]["outputs"]) == 3
    result = run_cli("generate", "abc", "--beam-width", "2", "--ignore-eos", *flags)
    assert result.returncode == 0, result.stderr
    beams = json.loads(result.stdout)[0]["outputs"]
    llm = LLM(str(tiny_model_dir), device="cpu")
    from minipaged import BeamSearchParams
    expected = llm.beam_search("abc", BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True),
                               use_tqdm=False)[0].sequences
    assert [b["token_ids"] for b in beams] == [e.tokens for e in expected]


@pytest.mark.parametrize("args", [["generate"], ["chat", "--block-size", "x"], ["nonsense"],
                                  ["generate", "hi", "--device", "tpu"]])
def test_bad_flags_give_usage_error(args):
    result = run_cli(*args)
    assert result.returncode == 2
    assert "usage:" in result.stderr


def test_bad_values_give_one_line_error(tiny_model_dir):
    result = run_cli("generate", "hi", "--model", str(tiny_model_dir), "--block-size", "12")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == "error: block_size must be a power of two between 1 and 256, got 12"
    assert "Traceback" not in result.stderr
    result = run_cli("generate", "hi", "--model", "no-such-model")
    assert result.returncode == 1 and "known models: smollm2-135m-instruct" in result.stderr
    result = run_cli("generate", "hi", "--model", str(tiny_model_dir), "--temperature", "-1")
    assert result.returncode == 1 and "temperature" in result.stderr and "Traceback" not in result.stderr


def test_help_explains_flags():
    result = run_cli("chat", "--help")
    assert result.returncode == 0
    for flag in ("--model", "--device", "--dtype", "--block-size", "--num-blocks", "--kv-cache-space",
                 "--max-num-seqs", "--max-model-len", "--temperature", "--top-p"):
        assert flag in result.stdout


@pytest.mark.slow
def test_chat_with_smollm2_answers():
    result = run_cli("chat", "--device", "cpu", "--temperature", "0", "--max-tokens", "32",
                     "--kv-cache-space", "0.25", stdin="What is the capital of France?\n")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


@pytest.mark.parametrize("args,message", [
    (["bench", "throughput", "--prefix-len", "5"], "--prefix-len does not apply to the throughput workload"),
    (["bench", "throughput", "--plot", "x.png"], "--plot draws the memory workload's KV pool"),
    (["bench", "single-stream", "--prompt", " "], "--prompt is empty"),
    (["bench", "single-stream", "--prompt", "caf\udcff"], "--prompt: encode() takes valid Unicode text"),
    (["bench", "single-stream", "--prompt", "hi", "--max-prompt-len", "4"], "drop --max-prompt-len"),
    (["bench", "roofline", "--prompt", "hi"], "--prompt does not apply to the roofline workload"),
    (["bench", "beam", "--peer", "hf"], "--peer runs one padded greedy batch"),
    (["bench", "memory", "--enable-prefix-caching"], "has no prefix caching"),
    (["bench", "roofline", "--num-prompts", "4"], "--num-prompts does not apply to the roofline workload"),
    (["bench", "throughput", "--batch-sizes", "4"], "--batch-sizes does not apply to the throughput workload"),
    (["bench", "roofline", "--batch-sizes", "1,x"], "--batch-sizes takes positive integers"),
    (["bench", "roofline", "--prefill-lens", "0"], "--prefill-lens takes positive integers"),
    (["bench", "roofline", "--steps", "0"], "--steps must be a positive integer"),
    (["generate", "hi", "--kv-allocator", "contiguous", "--enable-prefix-caching"],
     "prefix caching needs the paged allocator"),
    (["generate", "hi", "--seed", "-3"], "seed must be a non-negative integer"),
    (["generate", "hi", "--log-stats-interval", "-1"], "log_stats_interval must be a number of seconds"),
    (["generate", "hi", "--speculative-config", "{ngram"], "speculative_config is not valid JSON"),
    (["generate", "hi", "--speculative-config", '{"method": "ngram", "k": 3}'], "unknown keys ['k']"),
    (["generate", "hi", "--speculative-config", '{"method": "ngram"}', "--num-scheduler-steps", "4"],
     "do not combine"),
    (["bench", "spec-decode", "--batch-sizes", "4"], "--batch-sizes does not apply to the spec-decode workload"),
    (["generate", "hi", "-tp", "3"], "tensor_parallel_size=3 does not divide the model's 4 query heads"),
    (["generate", "hi", "-pp", "0"], "pipeline_parallel_size must be a positive integer"),
    (["bench", "roofline", "-pp", "2"], "the roofline workload reaches into one worker's model"),
    (["bench", "throughput", "--quantization", "gguf", "--cpu-gemm", "mkl"],
     "cpu_gemm='mkl' multiplies float32 weights"),
    (["bench", "quality", "--dtype", "bfloat16", "--cpu-gemm", "mkl"], "the CPU's bfloat16 weights are multiplied"),
    (["bench", "quality", "--weight-formats", "float32,int8", "--cpu-gemm", "mkl"],
     "--cpu-gemm mkl multiplies float32 weights only; --weight-formats float32,int8"),
    (["bench", "parallel", "-pp", "2"], "the parallel workload compares the splits itself"),
])
def test_flags_that_cannot_work_are_refused_before_loading(tiny_model_dir, args, message):
    result = run_cli(*args, "--model", str(tiny_model_dir), "--device", "cpu")
    assert result.returncode == 1, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


def test_chat_with_the_contiguous_allocator_leaves_prefix_caching_off(tiny_model_dir):
    result = run_cli("chat", "--model", str(tiny_model_dir), "--device", "cpu", "--kv-allocator", "contiguous",
                     "--max-model-len", "64", "--max-tokens", "4", "--temperature", "0", stdin="hello\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


def test_a_bad_log_level_falls_back_with_a_warning():
    import os  # noqa: PLC0415
    result = subprocess.run([sys.executable, "-c", "import minipaged"], capture_output=True, text=True,
                            env=dict(os.environ, MINIPAGED_LOG_LEVEL="loud"))
    assert result.returncode == 0 and "is not a log level" in result.stderr


def test_generate_split_over_workers_gives_the_same_tokens(tiny_model_dir):
    """-tp / -pp from the command line: the tiny model (4 query heads, 2 KV heads, 3 layers)
    split TP=2 x PP=2 answers as one worker does."""
    flags = ["generate", "abc", "--model", str(tiny_model_dir), "--device", "cpu", "--max-tokens", "6",
             "--ignore-eos", "--temperature", "0", "--json"]
    one = run_cli(*flags)
    split = run_cli(*flags, "-tp", "2", "-pp", "2")
    assert one.returncode == 0 and split.returncode == 0, split.stderr
    assert json.loads(split.stdout)[0]["outputs"][0]["token_ids"] == json.loads(one.stdout)[0]["outputs"][0]["token_ids"]


def test_kernels_flag_picks_the_tier(tiny_model_dir):
    """``--kernels simple``: the plain tier generates the same greedy tokens the library's fast
    tier does; a tier that does not exist is a usage error."""
    result = run_cli("generate", "abc", "--model", str(tiny_model_dir), "--device", "cpu", "--max-tokens", "6",
                     "--ignore-eos", "--temperature", "0", "--kernels", "simple", "--json")
    assert result.returncode == 0, result.stderr
    want = LLM(str(tiny_model_dir), device="cpu", kernels="fast").generate(
        "abc", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    assert json.loads(result.stdout)[0]["outputs"][0]["token_ids"] == want
    bad = run_cli("generate", "abc", "--model", str(tiny_model_dir), "--kernels", "turbo")
    assert bad.returncode == 2 and "--kernels" in bad.stderr and "turbo" in bad.stderr


@pytest.mark.parametrize("peer", ["hf", "llamacpp"])
def test_a_peer_that_is_not_installed_is_named_before_loading(tiny_model_dir, peer):
    """``bench --peer`` without the peers extra: one line naming the package and the extra."""
    import importlib.util  # noqa: PLC0415

    from minipaged.tools.bench_peers import PEER_MODULES  # noqa: PLC0415

    missing = [m for m in PEER_MODULES[peer] if importlib.util.find_spec(m) is None]
    if not missing:
        pytest.skip(f"the {peer} peer is installed here")
    result = run_cli("bench", "single-stream", "--peer", peer, "--model", str(tiny_model_dir), "--device", "cpu")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"--peer {peer} needs {missing[0]}" in result.stderr and "pip install -e '.[peers]'" in result.stderr


def test_a_missing_peer_package_is_named_whatever_is_installed_here():
    """The check itself, on packages that exist nowhere: named, in one sentence, with the extra."""
    from minipaged.tools.bench_peers import check_peer_installed  # noqa: PLC0415

    with pytest.raises(ValueError, match=r"--peer hf needs no_such_pkg_a, no_such_pkg_b, which are not installed: "
                                         r"pip install -e '\.\[peers\]'"):
        check_peer_installed("hf", {"hf": ("numpy", "no_such_pkg_a", "no_such_pkg_b")})
    with pytest.raises(ValueError, match="needs no_such_pkg, which is not installed"):
        check_peer_installed("llamacpp", {"llamacpp": ("no_such_pkg",)})
    check_peer_installed("hf", {"hf": ("numpy",)})          # all there: no word
