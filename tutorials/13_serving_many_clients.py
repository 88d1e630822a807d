"""Tutorial 13: one server, many clients, one pool of blocks.

Goal: start `python -m minipaged serve`, the OpenAI-compatible server, and send it
requests from several clients that arrive at different times, as real users do. Watch
the pool through the server's own `/kv` endpoint while they run: each client's request
gets its own page table; a request that arrives while others decode joins their batch
at the next step (continuous batching across clients); the first blocks of a system
prompt that every client shares are mapped once (prefix caching, ref count > 1); and a
client that hangs up mid-answer gives its blocks back by the next step. The page at
`http://HOST:PORT/` draws the same map live in a browser.

The OS analogy: the system-call interface. Processes (clients) do not share an address
space or know of each other; they all enter the same kernel through one documented
gate, and the kernel multiplexes its memory among them.

Needs the serve extra:  pip install -e ".[serve]"
Run it:  python tutorials/13_serving_many_clients.py
(MINIPAGED_TUTORIAL_MODEL=/path/to/a/llama/dir picks another model; KEEP_OPEN=1 keeps the
server running at the end so you can open the live map in a browser.)
"""

import json
import os
import subprocess
import sys
import threading
import time

import httpx

MODEL = os.environ.get("MINIPAGED_TUTORIAL_MODEL", "smollm2-135m-instruct")
SYSTEM = ("You are a patient teacher of operating systems. Answer in two or three plain sentences, "
          "with one everyday example, and never use a technical word without explaining it first.")
QUESTIONS = ["What is a page table?", "Why is swapping slow?", "How does fork() save memory?",
             "What does a scheduler do?"]

# ---------------------------------------------------------------- 1. start the server
print("1. The server: `python -m minipaged serve --port 0` (port 0: the OS picks a free one).")
server = subprocess.Popen([sys.executable, "-m", "minipaged", "serve", "--model", MODEL, "--port", "0",
                           "--device", "cpu", "--block-size", "8", "--num-blocks", "96",
                           "--log-stats-interval", "0"],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
url = None
while url is None:
    line = server.stdout.readline()
    assert line, "the server exited before it listened"
    if " at http" in line:
        url = line.split(" at ")[1].split()[0]          # http://127.0.0.1:PORT/v1
base = url.removesuffix("/v1")
name = httpx.get(f"{url}/models").json()["data"][0]["id"]
print(f"   listening at {url}; it serves {name!r} (prefix caching on, as for chat)")
print("   (before it listens it ran a few dummy forward passes, a prefill and decode batches of 1-64,"
      "\n    so that the first client does not pay for loading the kernels: engine/warm_up.py)")


def kv() -> dict:
    return httpx.get(f"{base}/kv", timeout=30).json()


def pool_line(state: dict, letters: dict) -> str:
    """One character per block: the letter of the request that maps it, + if shared, c cached, . free."""
    chars = []
    for block in state["device"]:
        if block["state"] == "used":
            owner = letters.get(block["requests"][0], "?")
            chars.append("+" if block["ref_count"] > 1 else owner)
        else:
            chars.append("c" if block["state"] == "cached" else ".")
    return "".join(chars)


# ---------------------------------------------------------------- 2. clients arrive at different times
print("\n2. Four clients arrive 0.6 s apart; each streams its answer (POST /v1/chat/completions).")
answers: dict[int, str] = {}


def client(i: int, hang_up_after: int | None = None) -> None:
    body = {"model": name, "max_tokens": 64, "temperature": 0.0, "stream": True,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[i]}]}
    pieces = []
    with httpx.stream("POST", f"{url}/chat/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    pieces.append(chunk["choices"][0]["delta"]["content"])
                    if hang_up_after is not None and len(pieces) >= hang_up_after:
                        break                          # the client goes away mid-answer
    answers[i] = "".join(pieces)


threads = []
letters: dict[str, str] = {}
most_at_once, shared_seen, snapshots = 0, 0, []
start = time.monotonic()
for i in range(len(QUESTIONS)):
    threads.append(threading.Thread(target=client, args=(i,)))
    threads[-1].start()
    deadline = time.monotonic() + 0.6
    while time.monotonic() < deadline:                  # watch the pool while the next client waits
        state = kv()
        for table in state["tables"]:
            letters.setdefault(table["request"], "ABCDEFGH"[len(letters) % 8])
        most_at_once = max(most_at_once, len(state["tables"]))
        shared_seen = max(shared_seen, max((b["ref_count"] for b in state["device"]), default=0))
        snapshots.append((time.monotonic() - start, len(state["tables"]), state["counts"]["used"],
                          pool_line(state, letters)))
        time.sleep(0.03)   # often: on a fast CPU two answers overlap for a fraction of a second
for t in threads:
    t.join()
print("   t (s)  requests  used blocks  pool (A-D: a request's block, +: shared, c: cached, .: free)")
shown = -1.0
for t, n, used, line in snapshots:
    if t - shown < 0.4:                                 # a line every ~0.4 s
        continue
    shown = t
    print(f"   {t:5.1f}  {n:8d}  {used:11d}  {line}")
stats = httpx.get(f"{base}/stats").json()
print(f"   at most {most_at_once} requests held blocks at the same moment; "
      f"{stats['steps_with_several_requests']} engine steps served more than one client")
print(f"   the highest ref count seen: {shared_seen} (the system prompt's first blocks, named by the "
      "prefix cache, are mapped by every request that starts with them)")
assert most_at_once >= 2 and stats["steps_with_several_requests"] > 0
assert shared_seen >= 2
assert len(answers) == len(QUESTIONS) and all(answers.values())
print(f"   client 0 got: {answers[0][:100]!r}...")

# ---------------------------------------------------------------- 3. a client hangs up
print("\n3. A client that hangs up after 5 pieces of text: its request is aborted, its blocks freed.")
client(1, hang_up_after=5)
time.sleep(0.3)
after = kv()
print(f"   got {answers[1]!r}; now {after['counts']['used']} blocks are used and "
      f"{after['counts']['cached']} are cached (free, their contents kept for a later prefix hit)")
assert after["counts"]["used"] == 0 and not after["tables"]

# ---------------------------------------------------------------- 4. what a monitoring system sees
print("\n4. GET /metrics: the same numbers under vLLM's Prometheus names.")
metrics = httpx.get(f"{base}/metrics").text
for wanted in ("vllm:num_requests_running{", "vllm:gpu_cache_usage_perc{", "vllm:prompt_tokens_total{",
               "vllm:generation_tokens_total{", "vllm:prefix_cache_hits_total{"):
    line = next(m for m in metrics.splitlines() if m.startswith(wanted))
    print(f"   {line}")
hits = float(next(m for m in metrics.splitlines() if m.startswith("vllm:prefix_cache_hits_total{")).split()[-1])
assert hits > 0

if os.environ.get("KEEP_OPEN"):
    print(f"\nThe server keeps running: open {base}/ in a browser (Ctrl-C here to stop it).")
    try:
        server.wait()
    except KeyboardInterrupt:
        pass
server.send_signal(2)                                   # Ctrl-C: aborts what is in flight, exits 0
print(f"\n   server: {server.communicate(timeout=60)[0].strip()}")
assert server.returncode == 0

print("""
Exercises:
  1. Run the clients with prefix caching off (add "--no-enable-prefix-caching" to the server's
     command) and compare the highest ref count and the blocks used at the peak. Which blocks
     stop being shared, and why is the last block of the system prompt never shared anyway?
  2. Start the server with --max-num-seqs 2 and send all four clients at once: how do the
     waiting requests show up in /kv and in vllm:num_requests_waiting, and when do they start?
""")
