"""Tutorial 21: operating the server: limits at the door, a heartbeat, and a watchdog.

Goal: see what `python -m minipaged serve` does before it is put in front of users, when
one user sends something absurd or a worker stops answering. A body over the limit is
refused before it is read; a prompt too long to ever fit is refused by its length in
characters, before the tokenizer spends a minute on it; a connection that never finishes
its headers is closed. Then the engine's heartbeat: /health and /stats answer from it
without waiting for the engine's thread, and a watchdog declares the engine dead when a step
runs past the step timeout, so that the server exits non-zero and a supervisor restarts it.

The OS analogy: resource limits (rlimits) checked at the system-call gate before any
work, and the kernel's hung-task watchdog, a timer that notices a task that stopped moving
without asking the task.

Needs the serve extra:  pip install -e ".[serve]"
Run it:  python tutorials/21_operating_the_server.py
"""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

from minipaged import LLM, SamplingParams
from minipaged.engine.async_llm_engine import AsyncLLMEngine, EngineDeadError

MODEL = os.environ.get("MINIPAGED_TUTORIAL_MODEL", "smollm2-135m-instruct")

# ---------------------------------------------------------------- 1. a server with tight limits
print("1. `serve` with the door's limits set low, to see them: --max-request-body-bytes 1000000,")
print("   --timeout-header-read 2 (seconds to send a whole request head), --step-timeout 30.")
server = subprocess.Popen([sys.executable, "-m", "minipaged", "serve", "--model", MODEL, "--port", "0",
                           "--device", "cpu", "--log-stats-interval", "0", "--max-request-body-bytes", "1000000",
                           "--timeout-header-read", "2", "--step-timeout", "30"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
url = None
while url is None:
    line = server.stdout.readline()
    assert line, "the server exited before it listened: " + server.stderr.read()[-2000:]
    if " at http" in line:
        url = line.split(" at ")[1].split()[0]
base = url.removesuffix("/v1")
name = httpx.get(f"{url}/models").json()["data"][0]["id"]
max_model_len = httpx.get(f"{url}/models").json()["data"][0]["max_model_len"]
print(f"   listening at {url}; max_model_len {max_model_len}")

# ---------------------------------------------------------------- 2. a body over the limit
big = json.dumps({"model": name, "prompt": "word " * 400_000, "max_tokens": 1}).encode()
start = time.perf_counter()
r = httpx.post(f"{url}/completions", content=big, headers={"content-type": "application/json"})
print(f"\n2. A {len(big) / 1e6:.1f} MB body: {r.status_code} in {time.perf_counter() - start:.2f} s, "
      "decided from its Content-Length header before a byte of it was read:")
print(f"   {r.json()['error']['message']}")
assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

# ---------------------------------------------------------------- 3. a prompt too long by its characters
r = httpx.post(f"{url}/completions", json={"model": name, "prompt": "word " * 150_000, "max_tokens": 1})
message = r.json()["error"]["message"]
print(f"\n3. A 750,000-character prompt (a 0.75 MB body, under the limit): {r.status_code}, before tokenizing:")
print(f"   {message}")
assert r.status_code == 400 and "characters" in message and "at most" in message
per_token = int(message.split("at most ")[1].split(" characters")[0])
print(f"   The bound: no token of this vocabulary stands for more than {per_token} characters (its longest")
print("   string, a run of spaces), so a text of C characters has at least C / "
      f"{per_token} tokens; past {per_token} x {max_model_len - 1}")
print("   characters it cannot fit, whatever its words. (Tokenizing 50 MB took 46 s; this answer takes none.)")
r = httpx.post(f"{url}/completions", json={"model": name, "prompt": "word " * 20_000, "max_tokens": 1})
print(f"   100,000 characters, under the bound: tokenized (in a thread that lets go of the GIL), then "
      f"{r.status_code}:\n   {r.json()['error']['message']}")
assert r.status_code == 400 and "tokens" in r.json()["error"]["message"]

# ---------------------------------------------------------------- 4. a connection that never finishes
port = int(base.rsplit(":", 1)[1])
with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")          # no blank line: the head never ends
    start = time.perf_counter()
    answer = s.recv(200)
    waited = time.perf_counter() - start
status_line = answer.split(b"\r\n")[0].decode()
print(f"\n4. A slow-loris connection (headers started, never finished): after {waited:.1f} s the server sent "
      f"{status_line!r} and closed it.")
assert answer.startswith(b"HTTP/1.1 408")

# ---------------------------------------------------------------- 5. the heartbeat under load
print("\n5. /health and /stats while 8 long answers stream: both come from the engine's heartbeat (the")
print("   stats copied between two steps), never from a wait for the engine's thread.")
results = []


def stream_one(i: int) -> None:
    body = {"model": name, "prompt": f"Story {i}: once upon a time", "max_tokens": 120, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{url}/completions", json=body, timeout=120) as r:
        results.append(sum(1 for line in r.iter_lines() if line.startswith("data: {")))


threads = [threading.Thread(target=stream_one, args=(i,)) for i in range(8)]
for t in threads:
    t.start()
time.sleep(1.0)
waits = []
for _ in range(10):
    start = time.perf_counter()
    health = httpx.get(f"{base}/health").status_code
    running = httpx.get(f"{base}/stats").json()["num_running"]
    waits.append(time.perf_counter() - start)
    time.sleep(0.1)
for t in threads:
    t.join()
print(f"   /health {health}, {running} requests running; the two answers took {min(waits) * 1e3:.0f}-"
      f"{max(waits) * 1e3:.0f} ms together")
assert health == 200 and len(results) == 8

server.send_signal(signal.SIGTERM)
out, err = server.communicate(timeout=60)
print(f"   SIGTERM (a supervisor stopping a healthy server): exit {server.returncode}; {out.strip().splitlines()[-1]}")
assert server.returncode == 0 and "KV blocks in use: 0" in out

# ---------------------------------------------------------------- 6. the watchdog
print("\n6. The watchdog, in-process. A worker that stops answering is made here by a step that waits")
print("   (the Ray version, a worker stopped with SIGSTOP, is in tests/test_server_faults.py).")
llm = LLM(MODEL, device="cpu", num_blocks=64)
engine = AsyncLLMEngine(llm.llm_engine, step_timeout=1.0)
release, real_step = threading.Event(), llm.llm_engine.step


def hung_step():                       # the 3rd step hangs, as a stopped worker would
    if llm.llm_engine.metrics.num_steps >= 2:
        release.wait(60)
    return real_step()


llm.llm_engine.step = hung_step
deaths = []
engine.dead_listeners.append(deaths.append)      # the server's listener stops uvicorn and exits 1


async def watch() -> None:
    stream = await engine.add_request("r", "The kernel's watchdog", SamplingParams(max_tokens=50, ignore_eos=True))
    tokens, started = 0, time.monotonic()
    try:
        async for out in stream:
            tokens = len(out.outputs[0].token_ids)
    except EngineDeadError as err:
        print(f"   after {tokens} tokens and {time.monotonic() - started:.1f} s the request got EngineDeadError:")
        print(f"   {err}")
    print(f"   health(): {engine.health()}")
    stats = await asyncio.wait_for(engine.get_stats(), 1.0)
    print(f"   get_stats() still answers, from the heartbeat: {stats['num_running']} running, "
          f"{stats['kv_blocks_used']} blocks used")
    release.set()
    await engine.shutdown()


asyncio.run(watch())
assert len(deaths) == 1 and "step timeout of 1 s" in str(deaths[0])
print(f"   the dead-engine listeners heard it once: {type(deaths[0]).__name__}; `serve` then answers the")
print("   requests in flight with 503 and exits 1 (docs/serving.md has a systemd unit that restarts it).")

print("\nExercises:")
print("  1. Run `python -m minipaged.tools.soak --requests 100 -- --log-stats-interval 0` and read its")
print("     report: which faults does it mix in, and what must hold at the end?")
print("  2. Start `serve --no-enable-chunked-prefill`, stream a few answers, then send a 6,000-token")
print("     prompt: how long do the streams freeze? Then again with chunked prefill on (the default).")
