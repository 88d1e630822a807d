"""The server under the faults an operator meets: requests too large to take, connections that
never finish their headers, an engine step that hangs, a worker that is stopped or killed.

Each test names the fault, drives the real server (``python -m minipaged serve`` in a child
process) or the real AsyncLLMEngine, and checks what a client and a supervisor would see:
the status codes, the error JSON, /health, the exit status, and that the other users were
served. The oracles are independent: the tokenizer's own vocabulary and encoder for the
character bound, the offline engine for the answers.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minipaged import LLM, SamplingParams
from minipaged.engine.async_llm_engine import AsyncLLMEngine, EngineDeadError
from minipaged.model.tokenizer import Tokenizer, chars_per_token_bound

from server_process import MODEL, ServerProcess

MAX_MODEL_LEN = 512            # the tiny model's context


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    s = ServerProcess(tiny_model_dir, "--max-request-body-bytes", "200000", "--timeout-header-read", "1",
                      "--timeout-keep-alive", "1")
    yield s
    code, output = s.stop(signal.SIGTERM)           # a healthy server stopped by its supervisor
    assert code == 0, output[-3000:]
    assert "minipaged: stopped" in output and "Traceback" not in output


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


# ---------------------------------------------------------------- requests too large to take

def test_a_body_over_the_limit_is_a_413_and_a_small_request_beside_it_is_served(server):
    big = json.dumps({"model": MODEL, "prompt": "word " * 60_000, "max_tokens": 1}).encode()   # 300 kB
    r = httpx.post(f"{server.url}/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "request_too_large" and "200000 bytes" in r.json()["error"]["message"]

    def chunks():                                   # no Content-Length: refused once 200 kB were read
        for i in range(0, len(big), 16384):
            yield big[i:i + 16384]
    r = httpx.post(f"{server.url}/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "over 200000 bytes" in r.json()["error"]["message"]

    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    done = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=3, temperature=0.0,
                                     extra_body={"ignore_eos": True})
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 3
    assert httpx.get(f"{server.base}/stats").json()["kv_blocks_used"] == 0


def test_a_prompt_too_long_by_its_characters_is_refused_before_it_is_tokenized(server, tokenizer):
    # The oracle: the longest string in the vocabulary, read here from tokenizer.json itself.
    vocab = json.loads(tokenizer.backend.to_str())
    longest = max(len(t) for t in [*vocab["model"]["vocab"], *(a["content"] for a in vocab["added_tokens"])])
    limit = (MAX_MODEL_LEN - 1) * longest
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    for chat, make in ((False, lambda text: client.completions.create(model=MODEL, prompt=text, max_tokens=1)),
                       (True, lambda text: client.chat.completions.create(
                           model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=1))):
        with pytest.raises(openai.BadRequestError) as err:
            make("a" * (limit + 1))
        message = err.value.body["message"]
        assert err.value.body["param"] == ("messages" if chat else "prompt")
        assert f"at most {limit} characters fit in {MAX_MODEL_LEN - 1} prompt tokens" in message
        assert ("rendered by the chat template" in message) if chat else (f"has {limit + 1} characters" in message)
        with pytest.raises(openai.BadRequestError) as err:       # under the bound: tokenized, then refused
            make("a" * 600)
        assert "tokens" in err.value.body["message"] and "characters" not in err.value.body["message"]
    r = httpx.post(f"{server.base}/tokenize", json={"prompt": "a" * (limit + 1)})   # vLLM's: a count, any length
    assert r.status_code == 200 and r.json()["count"] >= (limit + 1) / longest
    assert r.json()["count"] >= r.json()["max_model_len"]          # the bound was right: it cannot fit


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(min_size=1, max_size=300))
def test_a_text_has_at_least_its_length_over_the_bound_tokens(tokenizer, text):
    """The bound refuses only what could never fit: no text has fewer tokens than it says."""
    bound = chars_per_token_bound(tokenizer.backend)
    assert len(tokenizer.encode(text)) * bound >= len(text)


def test_the_bound_of_a_real_vocabulary_and_of_normalizers_that_shorten_text():
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, normalizers, pre_tokenizers

    def backend(model, normalizer=None, pre=None):
        b = Backend(model)
        if normalizer is not None:
            b.normalizer = normalizer
        if pre is not None:
            b.pre_tokenizer = pre
        return b

    bpe = models.BPE(vocab={"a": 0, "b": 1, "ab": 2, "abab": 3}, merges=[("a", "b"), ("ab", "ab")])
    assert chars_per_token_bound(backend(bpe)) == 4
    assert chars_per_token_bound(backend(bpe, normalizers.NFC())) == 16         # NFC composes up to 4 into 1
    assert chars_per_token_bound(backend(bpe, normalizers.Sequence([normalizers.Prepend("▁"),
                                                                     normalizers.Replace(" ", "▁")]))) == 4
    assert chars_per_token_bound(backend(bpe, normalizers.Strip())) is None     # unbounded: no bound
    assert chars_per_token_bound(backend(bpe, normalizers.Replace("aa", "a"))) is None
    assert chars_per_token_bound(backend(bpe, pre=pre_tokenizers.Whitespace())) is None
    assert chars_per_token_bound(backend(models.WordPiece(vocab={"[UNK]": 0, "a": 1}, unk_token="[UNK]"))) is None
    unigram = [("<unk>", 0.0), ("a", -1.0), ("ab", -1.5)]
    assert chars_per_token_bound(backend(models.Unigram(unigram, unk_id=0))) is None   # unknown runs fuse
    assert chars_per_token_bound(backend(models.Unigram(unigram, unk_id=0, byte_fallback=True))) == 5
    assert chars_per_token_bound(backend(bpe, pre=pre_tokenizers.Punctuation(behavior="removed"))) is None
    smollm2 = Path(os.environ.get("MINIPAGED_HOME", Path.home() / ".cache" / "minipaged")) / "models" / "smollm2-135m-instruct"
    if (smollm2 / "tokenizer.json").is_file():       # the real model's, where it was fetched
        real = Tokenizer.from_dir(smollm2)
        text = "word " * 2000 + "\n" + " " * 500 + "ünïcödé 123456"
        assert len(real.encode(text)) * real.max_chars_per_token >= len(text)


def test_tokenizing_a_long_prompt_lets_other_threads_run(tokenizer):
    """The encoder lets go of the GIL: the event loop (here a thread that sleeps in 5 ms steps)
    keeps running while a long prompt is tokenized in another thread."""
    text = "word " * 200_000
    wakeups, running = [], threading.Event()

    def encode():
        running.set()
        tokenizer.encode(text)
        running.clear()

    worker = threading.Thread(target=encode)
    worker.start()
    running.wait()
    started = time.monotonic()
    while running.is_set():
        time.sleep(0.005)
        wakeups.append(time.monotonic())
    took = time.monotonic() - started
    worker.join()
    if took < 0.1:
        pytest.skip(f"the encode took {took:.3f} s here: too short to tell")
    assert len(wakeups) >= 0.25 * took / 0.005, (len(wakeups), took)   # held, it would be 1 or 2


def test_the_first_step_may_take_longer_than_the_step_timeout():
    """The loop's first step may compile kernel variants the warm-up did not meet."""
    from minipaged.engine.liveness import Heartbeat

    beat = Heartbeat(step_timeout=0.05)
    beat.begin()
    time.sleep(0.1)
    assert beat.problem() is None                       # 10 x 0.05 s for the first step
    beat.end(lambda: {}, fresh=True)
    beat.begin()
    time.sleep(0.1)
    assert "more than the step timeout of 0.05 s" in beat.problem()


# ---------------------------------------------------------------- connections

def test_a_connection_that_never_finishes_its_headers_is_closed(server):
    port = int(server.base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:    # slow loris
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        started = time.monotonic()
        answer = s.recv(1000)
        assert answer.startswith(b"HTTP/1.1 408") and time.monotonic() - started < 20
        assert s.recv(1000) == b""                                          # and closed
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:    # a 413, and a body that never comes
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 300000\r\n\r\n")
        answer = b""
        while chunk := s.recv(4000):                     # the answer, then the server closes
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 413")          # then closed by the timer (it was waiting for the body)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:    # a body that stops coming
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        answer = b""
        while chunk := s.recv(4000):                     # the answer, then the server closes
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:    # keep-alive: closed when idle
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(1000).startswith(b"HTTP/1.1 200")
        assert s.recv(1000) == b""
    assert httpx.get(f"{server.base}/health").status_code == 200


def test_connections_beyond_the_concurrency_limit_get_a_503(tiny_model_dir):
    s = ServerProcess(tiny_model_dir, "--limit-concurrency", "2", "--api-key", "k", "--max-request-body-bytes", "1000")
    port = int(s.base.rsplit(":", 1)[1])
    try:
        r = httpx.post(f"{s.url}/completions", content=b"x" * 5000)        # no key: refused before the body
        assert r.status_code == 401
        r = httpx.post(f"{s.url}/completions", content=b"x" * 5000, headers={"authorization": "Bearer k"})
        assert r.status_code == 413
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        time.sleep(0.5)                              # both accepted before the third asks
        assert httpx.get(f"{s.base}/health").status_code == 503
        for c in held:
            c.close()
        deadline = time.monotonic() + 10
        while httpx.get(f"{s.base}/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        code, output = s.stop(signal.SIGTERM)
    assert code == 0, output[-2000:]


# ---------------------------------------------------------------- an engine step that hangs

def test_a_hung_step_turns_health_to_503_and_kills_the_engine(tiny_model_dir):
    """A step that never returns (a worker stuck in a collective, a stopped process): within the
    step timeout /health says so, the request in flight gets EngineDeadError, the stats are still
    answered from the heartbeat, and the listeners (the server's exit) hear of it once."""
    llm = LLM(str(tiny_model_dir), device="cpu", num_blocks=64, block_size=4, swap_space=0.01)
    engine = AsyncLLMEngine(llm.llm_engine, step_timeout=0.5)
    engine.heartbeat.stats_interval = 0.0        # a copy after every step, so the last one is known
    release, real_step, deaths = threading.Event(), llm.llm_engine.step, []
    engine.dead_listeners.append(deaths.append)

    def hanging_step():                      # the fault: the second step never comes back
        if llm.llm_engine.metrics.num_steps >= 1:
            release.wait(60)
        return real_step()

    llm.llm_engine.step = hanging_step

    async def main():
        params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
        assert engine.health() is None
        stream = await engine.add_request("r", [5, 6, 7], params)
        between = None
        with pytest.raises(EngineDeadError, match="step timeout of 0.5 s"):
            async for _ in stream:
                assert engine.health() is None or "has run for" in engine.health()
                between = between or asyncio.ensure_future(engine.call_between_steps(len, "queued"))
        with pytest.raises(EngineDeadError):             # /kv's call, queued behind the hung step: a 503
            await asyncio.wait_for(between, 1.0)
        assert "has run for" in engine.health()
        stats = await asyncio.wait_for(engine.get_stats(), 1.0)     # never waits on the hung thread
        assert stats["num_running"] == 1
        with pytest.raises(EngineDeadError):                         # nothing new is taken
            await engine.add_request("s", [5, 6], params)
        release.set()                                                # let the thread go
        await engine.shutdown()

    asyncio.run(main())
    assert len(deaths) == 1 and "step timeout" in str(deaths[0])


# ---------------------------------------------------------------- a Ray worker stopped, then killed

def descendants_named(pid: int, needle: str) -> list[int]:
    """Processes under ``pid`` (Ray's raylet starts the workers) whose command line holds ``needle``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            if needle in (Path("/proc") / str(p) / "cmdline").read_bytes().decode(errors="replace"):
                found.append(p)
        except OSError:
            pass
    return found


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory):
    """The tiny model with room for 16384 positions: a request of 16000 tokens runs for a while."""
    from tiny_model import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("long-llama"), max_position_embeddings=16384)


@pytest.mark.parametrize("fault", [signal.SIGSTOP, signal.SIGKILL], ids=["stopped", "killed"])
def test_a_lost_ray_worker_fails_the_requests_in_flight_and_ends_the_server(long_model_dir, fault):
    """vLLM's behaviour: the requests in flight get their error, /health says 503, and the server
    exits non-zero so that its supervisor restarts it. A stopped worker hangs its step (only
    the step timeout notices); a killed one fails it at once."""
    pytest.importorskip("ray")
    s = ServerProcess(long_model_dir, "--distributed-executor-backend", "ray", "--step-timeout", "3",
                      "--num-blocks", "4200", "--max-model-len", "16384")
    workers = []
    try:
        workers = descendants_named(s.proc.pid, "WorkerActor")
        assert workers, "no Ray worker process found under the server"
        body = {"model": MODEL, "prompt": list(range(3, 40)), "max_tokens": 16000, "temperature": 0.0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{s.url}/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            assert '"error"' not in first, (first, s.stop()[1][-3000:])
            for pid in workers:
                os.kill(pid, fault)
            events = [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) >= 2, events
        error = json.loads(events[-2][len("data: "):])["error"]
        assert error["type"] == "ServiceUnavailableError" and "engine loop stopped" in error["message"]
        code = s.proc.wait(timeout=60)                  # it ends by itself
        output = s.proc.stdout.read() + s.proc.stderr.read()
        assert code == 1, output[-3000:]
        assert "the engine died" in output and "supervisor restarts" in output
        assert ("step timeout of 3 s" if fault == signal.SIGSTOP else "Ray worker") in output, output[-3000:]
        assert "Traceback" not in output, output[-3000:]
    finally:
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if s.proc.poll() is None:
            s.stop(signal.SIGKILL)
