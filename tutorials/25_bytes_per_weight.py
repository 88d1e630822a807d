"""Tutorial 25: bytes per weight is the roofline of decode.

Goal: tutorial 14 measured that a single stream's decode step is bound by memory: it reads
every weight once to make one token. So the one way to make it faster is to read fewer
bytes. This tutorial stores the same SmolLM2 in four formats (docs/weights.md) and follows
the bytes from the checkpoint to the kernel and the clock:

- float32, 4 bytes a weight: the checkpoint as loaded;
- bfloat16 (``dtype="bfloat16"``), 2 bytes: the top half of each float32;
- int8 (``quantization="int8"``), 1 byte and a scale per output row;
- the GGUF's own blocks (``quantization="gguf"``): Q4_1, 0.625 bytes a weight (d, m and 32
  four-bit codes per block of 32), and Q8_0 for the embedding, as llama.cpp reads them;
- the same blocks with x rounded to int8 for every product (``quantization="gguf_a8"``),
  as llama.cpp multiplies them: the same bytes, fewer instructions a weight.

Step 1 counts the bytes a decode step must read in each. Step 2 takes one weight apart: a
Q4_1 block, its d, m and codes, and the error each format leaves. Step 3 checks the fast tier's
quantized panels against the spec (``QuantizedWeight.dequantize()``, then a plain product).
Step 4 turns bytes into a ceiling with this machine's read bandwidth. Step 5 runs the real
engine in each format: the time a token, against that ceiling, and the tokens themselves.
Step 6 rounds x to int8 as ``gguf_a8`` does and times the two kinds of Q4_1 product side by side.

The OS analogy: compressed memory (zram, squashfs). Pages kept in fewer bytes and expanded by
the CPU as they are read, because reading the small form and expanding it beats reading the
large one: a decode step widens each weight in registers (up to 8 rows) or into a small page
that stays in the core's L1 cache (more rows), never back into a copy in memory.

Timings depend on the machine and what else runs on it: they are printed, never asserted.
What is asserted: the byte counts, the blocks' meaning (against llama.cpp's own Python
dequantizer), the panels' products against the spec, and the tokens (the GGUF's blocks are
the very weights the float32 directory holds, widened: the same greedy tokens).

Run it:  python tutorials/25_bytes_per_weight.py
(MINIPAGED_TUTORIAL_MODEL=/path/to/a/llama/dir picks another model; step 5's gguf row needs a
*.gguf file in that directory.)

Exercises (also printed at the end):
  1. Run  python -m minipaged bench single-stream --quantization gguf --peer llamacpp  (the
     peers extra: pip install -e ".[peers]"; --prompt "your text" races a prompt of your own
     instead of random ids) and then with --quantization int8. Which is
     faster here, and why can int8, with 40% more bytes than the GGUF's blocks, come close? (Count the
     instructions a weight costs in a single row: kernels/fast/quant_blocks.py's block_row and
     kernels/fast/quant_panels.py's dense_row.)
  2. Run  python -m minipaged bench roofline --quantization gguf --batch-sizes 1,8,32. Where does
     the step stop being bound by the weights' bytes? What does the 'layers' line say the rest
     of a B=1 step is spent on?
  3. python -m minipaged bench quality --weight-formats float32,bfloat16,int8,gguf
     --kv-cache-dtypes auto,int8: do a compressed KV cache and compressed weights add up? Then
     score a text of your own (--text-file essay.txt): does the ranking of the formats hold?
  4. Run exercise 2's roofline with --quantization gguf_a8 and --batch-sizes 1,2,4,8. Which
     batch sizes gain from the integer products, and why not B=1? (Step 6's times, and the
     bytes a step reads.) Then bench quality --weight-formats gguf,gguf_a8: what did it cost?
"""

import os
import time

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from minipaged import LLM, SamplingParams
from minipaged.kernels.fast.quant_panels import pack, quant_panel_linear
from minipaged.kernels.weight_formats import BYTES_PER_WEIGHT, quantize, round_activations
from minipaged.model.config import LlamaConfig
from minipaged.model.fetch import resolve_model
from minipaged.model.weights import load_checkpoint
from minipaged.tools.roofline import read_bandwidth

MODEL = os.environ.get("MINIPAGED_TUTORIAL_MODEL", "smollm2-135m-instruct")
FORMATS = {"float32": dict(cpu_gemm="numba"), "bfloat16": dict(dtype="bfloat16"),
           "int8": dict(quantization="int8"), "gguf": dict(quantization="gguf"),
           "gguf_a8": dict(quantization="gguf_a8")}

model_dir = resolve_model(MODEL)
config = LlamaConfig.from_dir(model_dir)
tensors = load_checkpoint(model_dir)     # float32, memory-mapped

print("Step 1: the bytes a decode step reads, format by format")
matrices = {name: t for name, t in tensors.items() if t.ndim == 2}
head_tied = "lm_head.weight" not in tensors
weights = sum(t.size for t in matrices.values())          # the tied head is the embedding, read as the head
print(f"  {len(matrices)} matrices, {weights:,} weights (the embedding {tensors['model.embed_tokens.weight'].size:,}"
      f"{', tied: it is also the LM head' if head_tied else ''})")
gguf_bytes = (weights - tensors["model.embed_tokens.weight"].size) * BYTES_PER_WEIGHT["q4_1"] \
    + tensors["model.embed_tokens.weight"].size * BYTES_PER_WEIGHT["q8_0"]
step_bytes = {"float32": 4 * weights, "bfloat16": 2 * weights, "int8": weights + 4 * sum(t.shape[0] for t in
                                                                                      matrices.values()),
              "gguf": gguf_bytes}
for fmt, nbytes in step_bytes.items():
    print(f"  {fmt:>8}: {nbytes / 1e6:7.1f} MB a step  ({nbytes / weights:.3f} bytes a weight)")
assert step_bytes["float32"] == 4 * weights and step_bytes["bfloat16"] * 2 == step_bytes["float32"]
step_bytes["gguf_a8"] = gguf_bytes                         # the very same blocks: only x is rounded

print("\nStep 2: one weight taken apart (layer 0's gate_proj, (ffn, hidden))")
w = np.ascontiguousarray(tensors["model.layers.0.mlp.gate_proj.weight"])      # (ffn, hidden) float32
q4 = quantize(w, "q4_1")                                                       # (ffn, hidden / 32, 20) bytes
block = q4.data[0, 0]                                                          # row 0's first block: 20 bytes
d, m = block[0:2].view(np.float16)[0], block[2:4].view(np.float16)[0]
codes = np.concatenate([block[4:] & 15, block[4:] >> 4])                       # 32 codes, 0..15
print(f"  row 0, weights 0..31: d = {float(d):.5f}, m = {float(m):.5f}, codes {codes[:8].tolist()} ...")
widened = np.float32(d) * codes.astype(np.float32) + np.float32(m)             # w = d * q + m
assert np.array_equal(widened, q4.dequantize()[0, :32])
assert np.array_equal(q4.dequantize(), gguf_dequantize(q4.data.reshape(w.shape[0], -1), GGMLQuantizationType.Q4_1))
print("  d * q + m is what llama.cpp's own dequantizer gives: True")
for fmt in ("bfloat16", "int8", "q4_1"):
    err = np.abs(quantize(w, fmt).dequantize() - w)                            # (ffn, hidden)
    print(f"  {fmt:>8}: mean |error| {err.mean():.2e}, largest {err.max():.2e} (weights' mean |w| {np.abs(w).mean():.2e})")
print("  (q4_1's error is 0 for the default model: its float32 weights are the GGUF's Q4_1 blocks, widened)"
      if MODEL == "smollm2-135m-instruct" else "")

print("\nStep 3: the fast tier's panels, widened in registers, against the spec")
rng = np.random.default_rng(0)
for fmt in ("bfloat16", "int8", "q4_1"):
    qw = quantize(w, fmt)
    panels = pack(qw)                                                          # the only copy the fast tier keeps
    for rows in (1, 8, 16):                                                   # registers: 1, 8; a page: 16
        x = rng.standard_normal((rows, w.shape[1])).astype(np.float32)        # (rows, hidden)
        spec = x @ qw.dequantize().T                                           # the plain tier's product
        got = quant_panel_linear(x, panels, 2)
        assert np.allclose(got, spec, rtol=1e-4, atol=1e-4 * np.abs(spec).max())
    print(f"  {fmt:>8}: {panels.nbytes / 1e6:.2f} MB of panels; 1, 8 and 16 rows agree with x @ dequantize().T: True")

print("\nStep 4: bytes into a ceiling")
bandwidth = read_bandwidth()
print(f"  this machine streams {bandwidth / 1e9:.1f} GB/s; a single stream can make at most:")
ceilings = {fmt: bandwidth / nbytes for fmt, nbytes in step_bytes.items()}
for fmt, ceiling in ceilings.items():
    print(f"  {fmt:>8}: {ceiling:6.0f} tokens/s  ({1e3 / ceiling:5.2f} ms a token for the weights alone)")

print("\nStep 5: the engine in each format (a 16-token prompt, 48 tokens greedy)")
prompt = "The three most important ideas of operating systems are"
params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
tokens = {}
has_gguf = any(model_dir.glob("*.gguf")) or MODEL == "smollm2-135m-instruct"
for fmt, kwargs in FORMATS.items():
    if fmt.startswith("gguf") and not has_gguf:
        print(f"  {fmt}: no *.gguf file in this model's directory; skipped")
        continue
    llm = LLM(MODEL, device="cpu", num_blocks=64, max_model_len=256, **kwargs)
    engine = llm.llm_engine
    llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)    # compile, touch
    engine.add_request("r", prompt, params)
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        for out in engine.step():
            if out.finished:
                tokens[fmt] = out.outputs[0].token_ids
        steps.append(time.perf_counter() - start)
    step_ms = 1e3 * float(np.median(steps[1:]))
    print(f"  {fmt:>8}: {engine.model.nbytes / 1e6:7.1f} MB held, {step_ms:5.2f} ms a token "
          f"({1e3 / step_ms:5.0f} tokens/s, {step_ms / (1e3 / ceilings[fmt]):.1f}x its ceiling); "
          f"first 48 tokens equal to float32's: {tokens[fmt] == tokens['float32']}")
    llm = engine = None
if "gguf" in tokens:
    assert tokens["gguf"] == tokens["float32"]     # the float32 directory is the GGUF's blocks, widened
    print("  gguf computes on the very weights the float32 directory holds: the same tokens, True")
agree = sum(a == b for a, b in zip(tokens["int8"], tokens["float32"]))
print(f"  int8 agrees with float32 on {agree} of 48 tokens; bfloat16 on "
      f"{sum(a == b for a, b in zip(tokens['bfloat16'], tokens['float32']))}")
print("  (the step's other work, attention, norms and the kernel's phases, is the same in every format:\n"
      "   the fewer the bytes, the larger its share; docs/weights.md)")
if "gguf_a8" in tokens:
    print(f"  gguf_a8 agrees with gguf on {sum(a == b for a, b in zip(tokens['gguf_a8'], tokens['gguf']))} of 48 "
          "tokens (x rounded: the logits move a little, and a greedy path can part)")

print("\nStep 6: x rounded to int8 a block of 32 (gguf_a8), and the integer products")
x = rng.standard_normal((8, w.shape[1])).astype(np.float32)                   # (8, hidden)
block = x[0, :32]
d = np.abs(block).max() / np.float32(127)                                       # the block's scale
show = lambda v: "[" + ", ".join(f"{float(e):.4f}" for e in v) + "]"                # noqa: E731
print(f"  x[0, :4] = {show(block[:4])}, d = max|x| / 127 = {d:.5f}, codes "
      f"{np.rint(block[:4] / d).astype(int).tolist()}, read back {show(round_activations(x)[0, :4])}")
a8 = quantize(w, "q4_1_a8")                                                    # q4_1's very bytes
plain, integer = pack(quantize(w, "q4_1")), pack(a8)
for rows in (1, 2, 8):
    xr = x[:rows]
    assert np.allclose(quant_panel_linear(xr, integer, 1), a8.product(xr), rtol=1e-4,
                       atol=1e-4 * np.abs(a8.product(xr)).max())             # the spec: round, then widen
    times = {}
    for name, panels in (("float x", plain), ("int8 x", integer)) * 3:       # alternated, one thread
        start = time.perf_counter()
        for _ in range(50):
            quant_panel_linear(xr, panels, 1)
        times.setdefault(name, []).append((time.perf_counter() - start) / 50)
    f, i = (1e6 * min(times[n]) for n in ("float x", "int8 x"))
    print(f"  {rows} row(s): q4_1 times float x {f:6.1f} us, times int8 x {i:6.1f} us ({f / i:.1f}x); "
          "equal to round_activations(x) @ dequantize().T: True")
print("  (one instruction multiplies 4 codes by 4 bytes of x and adds them, LANES lanes at once:\n"
      "   kernels/fast/quant_a8.py; a single row is bound by the memory either way on most hosts)")

print("\nDone: fewer bytes a weight, a higher ceiling; widened in registers, the same float32 arithmetic\n"
      "(or, with gguf_a8, x rounded to int8 and integer products, as llama.cpp computes them).")
print("\nExercises:\n" + __doc__.split("Exercises (also printed at the end):\n")[1])
