"""The OpenAI-compatible server, driven by clients nobody here wrote: the official ``openai``
package (sync, async, streaming) and ``httpx``. The server is ``python -m minipaged serve``
in a child process on a free loopback port (``--port 0``; it prints the URL it got)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from minipaged import LLM, SamplingParams

from server_process import MODEL, ServerProcess


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    s = ServerProcess(tiny_model_dir)
    yield s
    code, output = s.stop()
    assert code == 0, output[-3000:]
    assert "warmed up in" in output        # engine/warm_up.py ran before the URL was printed


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    return LLM(str(tiny_model_dir), device="cpu", swap_space=0.01, num_blocks=256, block_size=4)


def kv_blocks_used(server) -> int:
    """The pool's used blocks, from the server's own stats (after a step or two of grace)."""
    deadline = time.monotonic() + 10
    while True:
        used = httpx.get(f"{server.base}/stats", timeout=10).json()["kv_blocks_used"]
        if used == 0 or time.monotonic() > deadline:
            return used
        time.sleep(0.05)


PROMPTS = [list(range(3 + 5 * i, 30 + 5 * i)) for i in range(3)]


def test_models_health_version(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.base}/health").status_code == 200
    assert "version" in httpx.get(f"{server.base}/version").json()


def test_completions_equal_offline_greedy(client, offline):
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    want = [o.outputs[0] for o in offline.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                                    use_tqdm=False)]
    got = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=10, temperature=0.0,
                                    extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [w.text for w in want]
    assert all(c.finish_reason == "length" for c in got.choices)
    assert got.usage.prompt_tokens == sum(map(len, PROMPTS))
    assert got.usage.completion_tokens == 30 and got.usage.total_tokens == got.usage.prompt_tokens + 30


def test_completion_stream_equals_the_whole_answer(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0.0,
                                      extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0.0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices


def test_chat_equals_offline_chat(client, offline):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    want = offline.chat(messages, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0.0,
                                         extra_body={"ignore_eos": True})
    assert got.choices[0].message.role == "assistant" and got.choices[0].message.content == want
    assert got.usage.completion_tokens == 8
    # content as a list of text parts renders the same
    parts = [{"role": "system", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
             messages[1]]
    again = client.chat.completions.create(model=MODEL, messages=parts, max_completion_tokens=8, temperature=0.0,
                                           extra_body={"ignore_eos": True})
    assert again.choices[0].message.content == want


def test_chat_stream_shape(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 6 and not chunks[-1].choices


def test_logprobs_and_n(client):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                         temperature=1.0, seed=3, n=3, logprobs=True, top_logprobs=2)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    for choice in out.choices:
        content = choice.logprobs.content
        assert 1 <= len(content) <= 4                                  # one entry per token
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    legacy = client.completions.create(model=MODEL, prompt="abc", max_tokens=3, logprobs=2, temperature=0.0,
                                       extra_body={"ignore_eos": True})
    assert len(legacy.choices[0].logprobs.tokens) == 3 and len(legacy.choices[0].logprobs.top_logprobs[0]) == 2


# a third of the vocabulary stops a sample: n = 3 samples at temperature 1 end at different steps
EARLY_STOPS = list(range(3, 90))


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_each_choice_of_a_stream_finishes_exactly_once(client, api):
    """n = 3 streamed: a choice that stops early sends its finish chunk once, not again at every
    later step (issue 40: 26 and 27 times through this client)."""
    early = 0
    for seed in range(8):
        kwargs = dict(model=MODEL, max_tokens=40, n=3, temperature=1.0, seed=seed, stream=True,
                      extra_body={"stop_token_ids": EARLY_STOPS})
        if api == "chat":
            chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": "2+2?"}], **kwargs))
        else:
            chunks = list(client.completions.create(prompt="2+2?", **kwargs))
        finishes = [(i, c.choices[0].index, c.choices[0].finish_reason) for i, c in enumerate(chunks)
                    if c.choices and c.choices[0].finish_reason]
        assert sorted(index for _, index, _ in finishes) == [0, 1, 2], finishes
        assert all(not c.choices or c.choices[0].index != index or i <= at          # nothing after its finish
                   for i, c in enumerate(chunks) for at, index, _ in finishes)
        early += any(reason == "stop" for _, _, reason in finishes) and any(r == "length" for _, _, r in finishes)
    assert early >= 1            # some seed had a choice finish while the others went on


def test_a_prompt_must_leave_room_for_one_token(server, client, tiny_model_dir):
    """vLLM's rule: a prompt of max_model_len tokens (here 512) is a 400 naming the prompt, with
    max_tokens or without (issue 40: a chat prompt of exactly max_model_len was answered, one
    token past the context); one token fewer gets its one token."""
    from minipaged.model.tokenizer import Tokenizer

    limit = 512
    ok = client.completions.create(model=MODEL, prompt=[5] * (limit - 1), max_tokens=1,
                                   extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 1 and ok.choices[0].finish_reason == "length"
    for body in ({"prompt": [5] * limit}, {"prompt": [5] * limit, "max_tokens": 1}):
        r = httpx.post(f"{server.url}/completions", json={"model": MODEL, **body}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert "must leave room for at least one generated token" in r.json()["error"]["message"]
    template = Tokenizer.from_dir(tiny_model_dir)
    wrapper = len(template.encode(template.apply_chat_template([{"role": "user", "content": ""}],
                                                               add_generation_prompt=True), add_special_tokens=False))
    full = [{"role": "user", "content": "a" * (limit - wrapper)}]        # a byte a token: exactly 512
    r = httpx.post(f"{server.url}/chat/completions", json={"model": MODEL, "messages": full}, timeout=30)
    assert r.status_code == 400 and "512 tokens" in r.json()["error"]["message"]


def test_tokenize_detokenize(server):
    ids = httpx.post(f"{server.base}/tokenize", json={"prompt": "hello"}).json()
    assert ids["count"] == len(ids["tokens"]) > 0
    text = httpx.post(f"{server.base}/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"]
    assert "hello" in text


@pytest.mark.parametrize("body, status, param", [
    ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": [10**9]}, 400, "prompt"),
    ({"model": MODEL, "prompt": list(range(3, 3 + 600))}, 400, "prompt"),
    ({"model": "nope", "prompt": "x"}, 404, "model"),
    ({"prompt": "x"}, 400, "model"),
    ({"model": MODEL, "prompt": "x", "presence_penalty": 5}, 400, "presence_penalty"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 10**6}, 400, "max_tokens"),       # vLLM refuses, not caps
    ({"model": MODEL, "prompt": [True, 2]}, 400, "prompt"),
    ({"model": MODEL, "prompt": "x", "suffix": "y"}, 400, "suffix"),
    ({"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"999999": 1}}, 400, "logit_bias"),
])
def test_bad_requests_get_openai_errors(server, body, status, param):
    r = httpx.post(f"{server.url}/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and "Traceback" not in r.text


def test_malformed_body_and_the_server_still_serves(server, client):
    r = httpx.post(f"{server.url}/chat/completions", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] is None
    hi = [{"role": "user", "content": "hi"}]
    for extra, param in (({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 10**4},
                                                                "top_logprobs"),
                         ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice")):
        r = httpx.post(f"{server.url}/chat/completions", json={"model": MODEL, "messages": hi, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
    r = httpx.post(f"{server.url}/chat/completions", json={"model": MODEL, "messages": [{"role": "user"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=2).choices[0].finish_reason
    assert kv_blocks_used(server) == 0


def test_the_openai_client_sees_typed_errors(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", top_p=5)
    assert "top_p" in str(err.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")


def test_concurrent_streaming_clients_share_steps(server, tiny_model_dir, offline):
    """32 streaming clients at once: each gets exactly its own greedy tokens, and the engine
    ran several of them in the same step (continuous batching across clients)."""
    prompts = [list(range(3 + i, 12 + i)) for i in range(32)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = [o.outputs[0].text for o in offline.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                        use_tqdm=False)]
    client = openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    before = httpx.get(f"{server.base}/stats").json()["steps_with_several_requests"]

    async def one(prompt) -> str:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0.0,
                                                 stream=True, extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def main():
        return await asyncio.wait_for(asyncio.gather(*[one(p) for p in prompts]), timeout=300)

    assert asyncio.run(main()) == want
    after = httpx.get(f"{server.base}/stats").json()["steps_with_several_requests"]
    assert after - before > 0
    assert kv_blocks_used(server) == 0


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory):
    """The tiny model with room for 16384 positions: a 16000-token request is still running
    seconds later, so a test can act while it is in flight."""
    from tiny_model import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("long-llama"), max_position_embeddings=16384)


LONG_FLAGS = ("--num-blocks", "4200", "--max-model-len", "16384")
LONG_BODY = {"model": MODEL, "prompt": list(range(3, 40)), "max_tokens": 16000, "temperature": 0.0,
             "ignore_eos": True}


def test_a_dropped_connection_frees_its_blocks(long_model_dir):
    s = ServerProcess(long_model_dir, *LONG_FLAGS)
    try:
        with httpx.stream("POST", f"{s.url}/completions", json={**LONG_BODY, "stream": True}, timeout=60) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            deadline = time.monotonic() + 10                                    # in flight (the stats
            while httpx.get(f"{s.base}/stats").json()["kv_blocks_used"] == 0:     # are copied every 0.25 s)
                assert time.monotonic() < deadline
                time.sleep(0.05)
            r.close()                                   # hang up
        assert kv_blocks_used(s) == 0                   # aborted, blocks freed
        # not streaming: the client times out and goes away
        client = openai.OpenAI(base_url=s.url, api_key="unused", max_retries=0, timeout=1.0)
        with pytest.raises(openai.APITimeoutError):
            client.completions.create(**{k: v for k, v in LONG_BODY.items() if k != "ignore_eos"},
                                      extra_body={"ignore_eos": True})
        assert kv_blocks_used(s) == 0
        assert httpx.get(f"{s.base}/stats").json()["generation_tokens"] < 2 * 16000   # neither ran to the end
    finally:
        code, output = s.stop()
    assert code == 0, output[-2000:]


def test_api_key_and_queue_limit(tiny_model_dir):
    s = ServerProcess(tiny_model_dir, "--api-key", "sekrit", "--max-queued-requests", "0")
    try:
        r = httpx.get(f"{s.url}/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url, api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=s.url, api_key="sekrit", max_retries=0)
        assert [m.id for m in good.models.list().data] == [MODEL]
        with pytest.raises(openai.APIStatusError) as err:        # max 0 waiting: every request is refused
            good.completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert err.value.status_code == 503
    finally:
        code, output = s.stop()
    assert code == 0, output[-2000:]


def test_ctrl_c_aborts_requests_in_flight_and_exits_0(long_model_dir):
    """One streaming and one plain request in flight at SIGINT: both are aborted (the plain one
    gets a 503), nothing is held, the process exits 0 and logs no traceback."""
    import threading

    s = ServerProcess(long_model_dir, *LONG_FLAGS)
    plain = {}
    thread = threading.Thread(target=lambda: plain.update(
        r=httpx.post(f"{s.url}/completions", json=LONG_BODY, timeout=120)))
    with httpx.stream("POST", f"{s.url}/completions", json={**LONG_BODY, "stream": True}, timeout=60) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        thread.start()
        deadline = time.monotonic() + 30
        while httpx.get(f"{s.base}/stats").json()["num_running"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        code, output = s.stop(signal.SIGINT)
    thread.join(timeout=60)
    assert code == 0, output[-2000:]
    assert "aborted 2 request(s) in flight; KV blocks in use: 0" in output
    assert "Traceback" not in output, output[-3000:]
    assert plain["r"].status_code == 503 and plain["r"].json()["error"]["type"] == "ServiceUnavailableError"


def test_metrics_under_vllm_names(server, client):
    from prometheus_client.parser import text_string_to_metric_families

    client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0.0,
                              extra_body={"ignore_eos": True})
    text = httpx.get(f"{server.base}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_requests_swapped",
                 "vllm:gpu_cache_usage_perc", "vllm:cpu_cache_usage_perc", "vllm:num_preemptions",
                 "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:prefix_cache_queries",
                 "vllm:prefix_cache_hits", "minipaged:swap_out_bytes", "minipaged:swap_in_bytes",
                 "vllm:time_to_first_token_seconds", "vllm:time_per_output_token_seconds",
                 "vllm:e2e_request_latency_seconds"):
        assert name in families, name
    value = {s.name: s.value for f in families.values() for s in f.samples if s.labels.get("model_name") == MODEL}
    stats = httpx.get(f"{server.base}/stats").json()
    assert value["vllm:generation_tokens_total"] == stats["generation_tokens"] > 0
    assert value["vllm:prompt_tokens_total"] == stats["prompt_tokens"]
    assert value["vllm:e2e_request_latency_seconds_count"] >= 1
    assert value["vllm:time_to_first_token_seconds_count"] >= 1
    assert value["vllm:num_requests_running"] == 0 and value["vllm:gpu_cache_usage_perc"] == 0


def test_kv_map_shows_a_running_request(long_model_dir):
    s = ServerProcess(long_model_dir, *LONG_FLAGS)
    try:
        with httpx.stream("POST", f"{s.url}/completions", json={**LONG_BODY, "stream": True}, timeout=60) as r:
            lines = r.iter_lines()
            first = json.loads(next(line for line in lines if line.startswith("data: {"))[6:])
            kv = httpx.get(f"{s.base}/kv").json()
            (table,) = kv["tables"]
            assert table["request"].startswith(first["id"]) and not table["on_cpu"]
            assert sum(table["fills"]) >= len(LONG_BODY["prompt"])
            for block in table["blocks"]:
                entry = kv["device"][block]
                assert entry["state"] == "used" and entry["ref_count"] == 1 and entry["requests"] == [table["request"]]
            assert kv["counts"]["used"] == len(table["blocks"])
            assert kv["counts"]["used"] + kv["counts"]["free"] + kv["counts"]["cached"] == kv["num_blocks"]
            page = httpx.get(f"{s.base}/").text
            assert "<svg" in page and 'fetch("kv")' in page
            r.close()
        kv = httpx.get(f"{s.base}/kv").json()
        assert kv["counts"]["used"] == 0 and not kv["tables"]
    finally:
        code, output = s.stop()
    assert code == 0, output[-2000:]


def chromium() -> str | None:
    import shutil

    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def test_the_live_map_renders_in_headless_chromium(long_model_dir, tmp_path):
    """The page at / drawn by a real browser while a request runs: its SVG has used blocks."""
    browser = chromium()
    if browser is None:
        if os.environ.get("CI"):
            pytest.fail("CI must have chromium (.ci/run installs Debian's package)")
        pytest.skip("no chromium on this machine (apt-get install chromium)")
    s = ServerProcess(long_model_dir, *LONG_FLAGS)
    try:
        with httpx.stream("POST", f"{s.url}/completions", json={**LONG_BODY, "stream": True}, timeout=60) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=3000"]
            dom = subprocess.run([browser, *flags, "--dump-dom", f"{s.base}/"], capture_output=True, text=True,
                                 timeout=120).stdout
            shot = tmp_path / "kv.png"
            subprocess.run([browser, *flags, "--window-size=1300,700", f"--screenshot={shot}", f"{s.base}/"],
                           capture_output=True, timeout=120)
            r.close()
        assert 'data-state="used"' in dom and 'data-used-blocks="0"' not in dom
        assert "used," in dom and "sequences" in dom          # the summary line was drawn
        assert shot.exists() and shot.stat().st_size > 10_000
    finally:
        code, output = s.stop()
    assert code == 0, output[-2000:]


def test_bench_serve_reports_like_vllms_serving_benchmark(tiny_model_dir, tmp_path):
    out = tmp_path / "serve.json"
    done = subprocess.run([sys.executable, "-m", "minipaged", "bench", "serve", "--model", str(tiny_model_dir),
                           "--device", "cpu", "--swap-space", "0.01", "--log-stats-interval", "0",
                           "--num-prompts", "6", "--min-prompt-len", "8", "--max-prompt-len", "30",
                           "--output-len", "5", "--request-rate", "40", "--max-concurrency", "4",
                           "--compare-offline", "--compare-idle", "--repeats", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())["result"]
    assert result["requests"] == 6 and result["failed"] == 0 and result["output_tokens"] == 30
    for key in ("request_throughput", "output_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "itl_p99_s",
                "offline_output_tok_s", "server_vs_offline", "idle_ttft_p50_s", "ttft_p50_vs_idle"):
        assert result[key] > 0, key
    # two whole measurements: each ratio is the median of its two runs
    for ratio in ("server_vs_offline", "ttft_p50_vs_idle"):
        runs = result[ratio + "_runs"]
        assert len(runs) == 2 and result[ratio] == pytest.approx(sum(runs) / 2)
    assert "request_throughput" in done.stdout


def test_schemathesis_finds_no_server_error(server, tmp_path):
    """Schemathesis generates requests from the server's own OpenAPI schema (valid, invalid,
    edge cases) and checks that none gets a 5xx; then the server is idle with 0 blocks."""
    import shutil
    from pathlib import Path

    cli = Path(sys.executable).parent / "schemathesis"     # the console script of this environment
    done = subprocess.run([str(cli) if cli.exists() else shutil.which("schemathesis"), "run", f"{server.base}/openapi.json", "--checks", "not_a_server_error",
                           "--max-examples", "40", "--request-timeout", "60", "--seed", "1"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)   # it writes .schemathesis/
    assert done.returncode == 0, done.stdout[-4000:]
    assert " passed" in done.stdout and "failed" not in done.stdout.split("SUMMARY")[-1]
    assert kv_blocks_used(server) == 0


def test_penalties_and_bias_through_the_server_equal_offline(client, offline):
    fields = dict(presence_penalty=0.8, frequency_penalty=0.4, repetition_penalty=1.3)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, **fields,
                            logit_bias={7: 3.0, 9: -5.0})
    want = offline.generate({"prompt_token_ids": PROMPTS[1]}, params, use_tqdm=False)[0].outputs[0]
    got = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0.0,
                                    presence_penalty=0.8, frequency_penalty=0.4, logit_bias={"7": 3.0, "9": -5.0},
                                    extra_body={"ignore_eos": True, "repetition_penalty": 1.3})
    assert got.choices[0].text == want.text
    biased = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=4, temperature=0.0,
                                       logit_bias={"70": 100}, extra_body={"ignore_eos": True})
    assert biased.choices[0].text == offline.get_tokenizer().decode([70] * 4)


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_beam_search_through_the_server_equals_offline_and_finishes_each_beam_once(client, offline, api):
    """vLLM's use_beam_search (n beams, the n best back, ranked): the same beams as
    LLM.beam_search, whole or streamed; a stream sends each beam's finish exactly once."""
    from minipaged.engine.beam_search import BeamSearchParams

    tokenizer = offline.get_tokenizer()
    if api == "chat":
        messages = [{"role": "user", "content": "Count: one two"}]
        prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    else:
        prompt_ids = PROMPTS[2]
    want = offline.beam_search([{"prompt_token_ids": prompt_ids}], BeamSearchParams(beam_width=3, max_tokens=8),
                               use_tqdm=False)[0].sequences
    want_texts = [tokenizer.decode(b.tokens[len(prompt_ids):], skip_special_tokens=True) for b in want]
    extra = {"use_beam_search": True}
    for stream in (False, True):
        if api == "chat":
            got = client.chat.completions.create(model=MODEL, messages=messages, n=3, max_tokens=8, stream=stream,
                                                 extra_body=extra)
        else:
            got = client.completions.create(model=MODEL, prompt=prompt_ids, n=3, max_tokens=8, stream=stream,
                                            temperature=0.0, extra_body=extra)   # greedy: allowed
        if not stream:
            texts = [c.message.content if api == "chat" else c.text for c in got.choices]
        else:
            texts, finishes = ["", "", ""], [0, 0, 0]
            for chunk in got:
                for c in chunk.choices:
                    texts[c.index] += (c.delta.content if api == "chat" else c.text) or ""
                    finishes[c.index] += c.finish_reason is not None
            assert finishes == [1, 1, 1]
        assert texts == want_texts
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=prompt_ids, n=2, max_tokens=4, stop=["x"],
                                  extra_body=extra)
    assert err.value.body["param"] == "stop" and "use_beam_search" in err.value.body["message"]


def test_echo_with_logprobs_scores_the_prompt(client, offline):
    """echo + logprobs: the prompt's own log-probabilities (the first token has none), then the
    completion's; the prompt part equals the engine's prompt_logprobs offline."""
    prompt = PROMPTS[2][:12]
    want = offline.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=3, logprobs=1,
                                                                         prompt_logprobs=1, ignore_eos=True),
                            use_tqdm=False)[0]
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0.0, logprobs=1,
                                    echo=True, extra_body={"ignore_eos": True}).choices[0]
    lp = got.logprobs
    assert len(lp.tokens) == len(prompt) + 3 and lp.token_logprobs[0] is None
    for i, token in enumerate(prompt[1:], start=1):
        assert lp.token_logprobs[i] == pytest.approx(want.prompt_logprobs[i][token], abs=1e-5)
    assert got.text.startswith(offline.get_tokenizer().decode(prompt))


@pytest.mark.slow
def test_smollm2_end_to_end_through_the_server():
    """The real model behind the server: greedy chat and completions equal LLM offline, and the
    answer to a question a 135M model knows."""
    s = ServerProcess("smollm2-135m-instruct", "--max-model-len", "1024", "--enable-prefix-caching")
    try:
        client = openai.OpenAI(base_url=s.url, api_key="unused", max_retries=0, timeout=300)
        messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
        got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0.0)
        text = httpx.post(f"{s.url}/completions", timeout=300, json={
            "model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0.0}).json()
    finally:
        code, output = s.stop()
    assert code == 0, output[-2000:]
    offline = LLM("smollm2-135m-instruct", device="cpu", max_model_len=1024, num_blocks=256, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    assert got.choices[0].message.content == offline.chat(messages, params, use_tqdm=False)[0].outputs[0].text
    assert "Paris" in got.choices[0].message.content
    want = offline.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0].text
    assert text["choices"][0]["text"] == want and text["usage"]["completion_tokens"] == 8


def test_a_client_that_stops_reading_then_hangs_up_is_aborted(tiny_model_dir):
    """The server blocks writing to a client whose socket buffer is full (250 samples with
    logprobs: hundreds of KB a step); when that client hangs up, its request must still be
    aborted at once (and its output queue dropped), not run to max_tokens."""
    import socket

    s = ServerProcess(tiny_model_dir, "--num-blocks", "8000", "--block-size", "16")
    try:
        host, port = s.base.removeprefix("http://").split(":")
        body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 400, "ignore_eos": True, "stream": True,
                           "n": 250, "logprobs": 20}).encode()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((host, int(port)))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(2)                                    # read nothing: the server's writes back up
        assert httpx.get(f"{s.base}/stats").json()["kv_blocks_used"] > 0
        sock.close()
        assert kv_blocks_used(s) == 0
        assert httpx.get(f"{s.base}/stats").json()["generation_tokens"] < 250 * 400   # it did not run to the end
    finally:
        code, output = s.stop()
    assert code == 0 and "aborted 0 request(s) in flight" in output, output[-2000:]


def test_a_speculating_server_gives_the_same_tokens_and_exports_its_counters(tiny_model_dir, offline):
    """``serve --speculative-config JSON``: the official client gets the tokens the engine gives
    without speculation, and /metrics carries vLLM's speculative-decoding counters."""
    from prometheus_client.parser import text_string_to_metric_families

    s = ServerProcess(tiny_model_dir, "--speculative-config",
                      '{"method": "ngram", "num_speculative_tokens": 4, "adaptive": false}')
    try:
        client = openai.OpenAI(base_url=s.url, api_key="unused", max_retries=0, timeout=60)
        prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0.0,
                                        logprobs=1, extra_body={"ignore_eos": True})
        want = offline.generate({"prompt_token_ids": prompt},
                                SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
        assert got.choices[0].text == want[0].outputs[0].text
        assert got.usage.completion_tokens == 24
        stats = httpx.get(f"{s.base}/stats").json()["spec_decode"]
        families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{s.base}/metrics").text)}
        value = {x.name: x.value for f in families.values() for x in f.samples}
        assert value["vllm:spec_decode_num_draft_tokens_total"] == stats["num_draft_tokens"] > 0
        assert value["vllm:spec_decode_num_accepted_tokens_total"] == stats["num_accepted_tokens"] > 0
        assert value["vllm:spec_decode_draft_acceptance_rate"] == pytest.approx(stats["acceptance_rate"])
    finally:
        code, output = s.stop()
    assert code == 0, output[-3000:]
