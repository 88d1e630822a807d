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

MODEL = "tiny"


class ServerProcess:
    def __init__(self, model_dir, *flags: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "minipaged", "serve", "--model", str(model_dir), "--port", "0",
             "--device", "cpu", "--swap-space", "0.01", "--num-blocks", "256", "--block-size", "4",
             "--served-model-name", MODEL, "--log-stats-interval", "0", *flags],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        self.url = None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            if "serving" in line and "http://" in line:
                self.url = line.split(" at ")[1].split()[0]       # http://127.0.0.1:PORT/v1
                break
        if self.url is None:
            self.proc.kill()
            raise RuntimeError(f"the server did not start: {self.proc.stderr.read()[-3000:]}")
        self.base = self.url[:-len("/v1")]

    def stop(self, sig=signal.SIGINT, timeout: float = 30) -> tuple[int, str]:
        self.proc.send_signal(sig)
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
        return self.proc.returncode, out + err


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    s = ServerProcess(tiny_model_dir)
    yield s
    code, output = s.stop()
    assert code == 0, output[-3000:]


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
    ({"model": MODEL, "prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
])
def test_bad_requests_get_openai_errors(server, body, status, param):
    r = httpx.post(f"{server.url}/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and "Traceback" not in r.text


def test_malformed_body_and_the_server_still_serves(server, client):
    r = httpx.post(f"{server.url}/chat/completions", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
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
            assert httpx.get(f"{s.base}/stats").json()["kv_blocks_used"] > 0     # in flight
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
    s = ServerProcess(long_model_dir, *LONG_FLAGS)
    with httpx.stream("POST", f"{s.url}/completions", json={**LONG_BODY, "stream": True}, timeout=60) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        assert httpx.get(f"{s.base}/stats").json()["kv_blocks_used"] > 0         # in flight
        code, output = s.stop(signal.SIGINT)
    assert code == 0, output[-2000:]
    assert "aborted 1 request(s) in flight; KV blocks in use: 0" in output
