"""Persistent decode: a decode step through every layer in one parallel region.

The analogy is a busy-polling driver (Linux's NAPI, DPDK's poll-mode drivers): at high rates an
interrupt per packet costs more than the packet, so the driver keeps its cores and polls for work.
A decode step is ~120 matrix products and ~200 small kernels, each a parallel region of its own
when run one by one (``ops.py``, layer by layer): each wakes the thread pool, splits its work
evenly and joins, and between two regions the memory bus idles while Python calls the next. One
sequence's step reads every weight once (538 MB for SmolLM2), so it is bound by memory, and an idle
bus is time lost for good; a larger batch's small kernels and region starts add up too.

Here the threads enter one region for all the layers (and the LM head, where this worker holds it)
and leave at the end. The step is a fixed list of **phases**: each product (qkv, o, gate/up, down,
the head) is a phase of tasks, a run of its weight's panels each (about
``layer_stack.TASK_BYTES``); the work between products (norms, rotary, the KV write, SiLU, the
residual adds) is a phase of one task a token (merging split attention, of one task); attention is
a phase of the plan's work items. A thread **claims** a phase's next task by adding one to a
counter (``kernels/atomics.py``), runs it, and counts it done in the phase's done counter; when no
task is left it **polls** the done counter until the phase is complete, then goes on to the next
phase. While it polls it asks for the lines of the next weight it will multiply (``prefetch``, up
to AHEAD_BYTES of it), so the bus keeps streaming weights while the other thread runs attention or
a norm.

A phase's tasks are cut into one contiguous **range** per iteration of the region, each with its
own counter (``_claim``): a thread takes its own range's tasks first, front to back, and then the
others' (**work stealing**, as per-CPU run queues are balanced). So each thread reads its share of
a weight as one stream, as a static split would, which the panels' read- ahead relies on: from one
shared counter, the two threads' tasks interleaved, and a whole step's products at 8 rows took 22.6
ms against 19.5 layer by layer (docs/benchmarks.md).

No thread waits for another to start: a task, once claimed, is run by the thread that claimed it
without waiting for anything (nor raising: every kernel it calls is compiled with NumPy's error
model and ``guarded``, so that a task that fails, an allocation say, marks the step failed, every
thread leaves the region at once and ``run`` raises; non-finite hidden states are reported after
the region), so the step completes whether the region's iterations run on many threads at once or
one after another on a single one (a threading layer may do either). And the threads take tasks as
they free up: a core that the host lends elsewhere for a while leaves its share to the other.

Each task calls the very kernels the layer-by-layer path calls, in the same order on the same
values, so the step's logits are the same floats (``tests/test_persistent_decode.py``): the panels'
own loops ``panel_gemm.panel_rows`` (on views that count no references, ``kernels/borrowed.py``:
counted, the loops of 8 rows and more ran 4x slower here), and the kernels ``ops.py`` binds this
one to (``compile_kernel``): the serial compilations (``two_ways(...).serial``) of its norms,
rotary, KV write and SiLU, each over one token's row, and its register attention kernel over one
work item. The layer-by-layer forward of ``model/llama.py`` is this kernel's spec.

It runs where all of that holds (``usable``, and ``ops.decode_layers``): as many new tokens as the
layer-by-layer path multiplies on the panels (``FastTuning.panel_max_rows``: decodes of up to 128
sequences, or short prompt chunks beside them), every one read by the paged attention kernel,
weights with their panels (float32 or quantized), a float32 KV cache the register attention kernel
reads, no block-sparse attention, no tensor-parallel split. Rows are padded with zero rows to a
multiple of 4 as the products pad them (``panel_gemm.padded_rows``); the padding rows stay zero.
"""

from __future__ import annotations

import types

import numpy as np
from numba import njit, prange

from .atomics import fetch_add, load_acquire, spin_pause
from .borrowed import borrowed
from .compile import guarded
from ..kv_quant import KV_FLOAT
from .layer_stack import LayerStack
from .panel_gemm import PANEL, padded_rows
from .quant_a8 import Q4_1_A8, Q8_0_A8, round_rows, rounded_size, rounds_x
from .quant_panels import any_panel_rows
from .simd import LANES, SIMD_CACHE, prefetch

# How much of the next weight a polling thread asks for ahead: while the other thread runs
# attention (~50 us at a 256-token context) one core streams ~1 MB; more would be evicted from
# the caches before the product reads it.
AHEAD_BYTES = 2 << 20
# int64s in a cache line. A phase's counters are a row of ``ctr``: its tasks done at column 0,
# then each range's tasks claimed, at LINE (r + 1): every counter on a cache line of its own.
LINE = 8
PHASES_PER_LAYER = 10
CACHE = SIMD_CACHE


# --------------------------------------------------------------------------- claiming and polling

@njit(inline="always", cache=CACHE)
def _failed(ctr):
    """Whether a task of this step has failed (the last row of ``ctr``: ``_fail``)."""
    return load_acquire(ctr[ctr.shape[0] - 1], 0) != 0


@njit(cache=CACHE)
def _fail(ctr):
    """Mark the step failed: every claim then finds no task and every wait ends, so each thread
    leaves the region; ``run`` raises."""
    fetch_add(ctr[ctr.shape[0] - 1], 0, 1)


@njit(cache=CACHE)   # not inlined: bound to the prange index, its r would overwrite it
def _claim(ctr, phase, tasks, r):
    """(task, range): the phase's next task, taken from range r first, then from the ranges
    after it in turn (task >= tasks: none is left anywhere). The phase's ``tasks`` are cut into
    one contiguous range per iteration of the region; each iteration starts with its own (r =
    its index) and goes on with the range it last took from, so a thread reads its share of
    a weight front to back, as a static split would, and takes over the others' tasks once
    its own are done (work stealing)."""
    row = ctr[phase]
    ranges = row.shape[0] // LINE - 1
    r = np.int64(r)                # (a prange index may come unsigned)
    if _failed(ctr):               # a task failed: nothing more is run
        return tasks, r
    for _ in range(ranges):
        task = r * tasks // ranges + fetch_add(row, LINE * (r + 1), 1)
        if task < (r + 1) * tasks // ranges:
            return task, r
        r = r + 1 if r + 1 < ranges else 0
    return tasks, r


@njit(inline="always", cache=CACHE)
def _done(ctr, phase):
    fetch_add(ctr[phase], 0, 1)


@njit(inline="always", cache=CACHE)
def _wait(ctr, phase, tasks, ahead, cursor, limit):
    """Poll until the phase's ``tasks`` are done; meanwhile ask for the lines of ``ahead`` (the
    next weight) from byte ``cursor`` up to ``limit``. Returns the cursor reached."""
    row = ctr[phase]
    while load_acquire(row, 0) < tasks and not _failed(ctr):
        if cursor < limit:
            prefetch(ahead, cursor)
            cursor += 64
        else:
            spin_pause()
    return cursor


@njit(fastmath=True, cache=CACHE, error_model="numpy")
def _product(ctr, phase, x, w, fmt, k_dim, panels, per_task, out, rows, it, blob):
    """Claim and run a product phase's tasks, iteration ``it`` of the region: x (rows * k_dim,) times
    per_task panels of w each, into out (rows * panels * PANEL,), through the panels' own loops
    (``panel_rows``; a quantized weight's, flat uint8 in format ``fmt``: ``quant_rows``). Returns
    the phase's task count. Not inlined: five copies of the panels' loops (five weights) took
    minutes to compile. A task's first panel asks for its own lines ahead (``first``) unless this
    thread has just run the task before it, whose passes asked for them."""
    tasks = -(-panels // per_task)
    if rounds_x(fmt):                          # x rounded into the iteration's blob, once (quant_a8.py)
        round_rows(x, rows, k_dim, blob)
    xs, ws, outs = borrowed(blob if rounds_x(fmt) else x), borrowed(w), borrowed(out)   # no reference counts
    task, r = _claim(ctr, phase, tasks, it)
    last = -2
    while task < tasks:
        first = task * per_task
        for p in range(first, min(panels, first + per_task)):
            any_panel_rows(xs, ws, fmt, k_dim, rows, outs, panels * PANEL, p, p == first and task != last + 1)
        _done(ctr, phase)
        last = task
        task, r = _claim(ctr, phase, tasks, r)
    return tasks


@njit(inline="always", cache=CACHE)
def _limit(w):
    return min(w.shape[0] * w.itemsize, AHEAD_BYTES)


@njit(fastmath=True, inline="always", cache=CACHE)
def _add_row(hidden, out, width, t):
    """hidden[t] (h,) += out's row t (flat, rows of width, the first h of it): the residual add."""
    for i in range(hidden.shape[1]):
        hidden[t, i] += out[t * width + i]


# --------------------------------------------------------------------------- the kernel

def _decode_layers_body(hidden, x, x_flat, qkv_out, q, k, v, attn, attn_flat, o_out, gu, gu_flat,
                        g, g_flat, d_out, input_norms, post_norms, qkv_w, o_w, gate_up_w, down_w,
                        widths, per_task, fmts, blobs, eps, positions, slot_mapping, kv_cache, cos, sin,
                        block_tables, seq_lens, query_start_loc, items, merges, scale, part_acc,
                        part_max, part_sum, strides, no_bounds, no_scales, final_norm, head_w,
                        logits, with_head, ctr, num_threads):
    """Every layer of a step of T tokens, in R rows (T, or T padded with zero rows to a multiple
    of 4: ``panel_gemm.padded_rows``). hidden (R, h): the embeddings in, the last layer's output
    out. x / x_flat (R, h) / (R * h,): a norm's output; qkv_out, o_out, d_out: flat (R x padded
    width) product outputs; q (T, H, D), k, v (T, KVH, D); attn (R, H, D) and its flat view;
    gu (R, W) gate/up and g (R, ffn) SiLU's output, each with its flat view. Rows T..R-1 of x,
    attn and g stay zero: the norms and SiLU run a task per token (rows 0..T-1), and a product
    keeps a zero row zero. The phases of layer l are 1 + 10 l + (0..9), phase 0 is layer 0's
    input norm; ``with_head``: the last layer's phase 9 also takes the final norm into x, and
    phase 1 + 10 L multiplies it by the LM head's panels head_w into logits (R x padded vocab,).
    ctr: (3 + 10 L, (num_threads + 1) * LINE) zeros, a row a phase (``_claim``), the last one the
    step's failure mark (``_fail``); iteration ``it`` of the region starts each phase in its own range.
    A product's weights are (L, n) arrays, a layer's flat panels a row: float32 panels, or
    quantized ones (uint8) in format fmts[i]. (Arrays, not tuples of L: the compiled code does
    not depend on the number of layers.) blobs (iterations, n): iteration it's "q4_1_a8" x."""
    num_layers = input_norms.shape[0]
    q_size, kv_size = q.shape[1] * q.shape[2], k.shape[1] * k.shape[2]
    tokens, rows = q.shape[0], x.shape[0]
    hidden_size, ffn = x.shape[1], g.shape[1]
    block_stride, head_stride, token_stride = strides[0], strides[1], strides[2]
    block_size, num_kv_heads, head_dim = kv_cache.shape[4], kv_cache.shape[3], q.shape[2]
    for it in prange(num_threads):
        # phase 0: layer 0's input norm, a token a task, while the others ask for layer 0's qkv
        t, r = _claim(ctr, 0, tokens, it)
        while t < tokens:
            if not RMS_NORM(hidden[t:t + 1], input_norms[0], eps, x[t:t + 1]):
                _fail(ctr)
            _done(ctr, 0)
            t, r = _claim(ctr, 0, tokens, r)
        cursor = _wait(ctr, 0, tokens, qkv_w[0], 0, _limit(qkv_w[0]))
        for layer in range(num_layers):
            base = 1 + PHASES_PER_LAYER * layer
            k_cache, v_cache = kv_cache[layer, 0], kv_cache[layer, 1]
            k_flat, v_flat = k_cache.reshape(-1), v_cache.reshape(-1)
            # 0. q, k, v = x @ qkv.T
            tasks = _product(ctr, base, x_flat, qkv_w[layer], fmts[0], hidden_size, widths[0] // PANEL, per_task[0],
                             qkv_out, rows, it, blobs[it])
            cursor = _wait(ctr, base, tasks, o_w[layer], 0, _limit(o_w[layer]))
            # 1. rotary on q and k, then k and v into the cache, a token a task
            t, r = _claim(ctr, base + 1, tokens, it)
            while t < tokens:
                row = t * widths[0]
                for h in range(q.shape[1]):
                    for d in range(head_dim):
                        q[t, h, d] = qkv_out[row + h * head_dim + d]
                for h in range(num_kv_heads):
                    for d in range(head_dim):
                        k[t, h, d] = qkv_out[row + q_size + h * head_dim + d]
                        v[t, h, d] = qkv_out[row + q_size + kv_size + h * head_dim + d]
                if not (ROTARY(q[t:t + 1], positions[t:t + 1], cos, sin)
                        and ROTARY(k[t:t + 1], positions[t:t + 1], cos, sin)
                        and WRITE_KV(k_cache, v_cache, k[t:t + 1], v[t:t + 1], slot_mapping[t:t + 1], KV_FLOAT,
                                     no_scales, no_scales)):
                    _fail(ctr)
                _done(ctr, base + 1)
                t, r = _claim(ctr, base + 1, tokens, r)
            cursor = _wait(ctr, base + 1, tokens, o_w[layer], cursor, _limit(o_w[layer]))
            # 2. attention: the plan's work items, one a task
            task, r = _claim(ctr, base + 2, items.shape[0], it)
            while task < items.shape[0]:
                if not ATTENTION(q, k_flat, v_flat, block_stride, head_stride, token_stride, block_size,
                                 num_kv_heads, block_tables, seq_lens, query_start_loc, scale,
                                 items[task:task + 1], 1, no_bounds, no_bounds, 0, part_acc, part_max,
                                 part_sum, attn):
                    _fail(ctr)            # its scratch could not be allocated, say
                _done(ctr, base + 2)
                task, r = _claim(ctr, base + 2, items.shape[0], r)
            cursor = _wait(ctr, base + 2, items.shape[0], o_w[layer], cursor, _limit(o_w[layer]))
            # 3. the split items' partial sums merged (a long context cut over the threads)
            if merges.shape[0]:
                if _claim(ctr, base + 3, 1, it)[0] == 0:
                    if not MERGE(part_acc, part_max, part_sum, merges, query_start_loc, q.shape[1], attn):
                        _fail(ctr)
                    _done(ctr, base + 3)
                cursor = _wait(ctr, base + 3, 1, o_w[layer], cursor, _limit(o_w[layer]))
            # 4. out = attn @ o.T
            tasks = _product(ctr, base + 4, attn_flat, o_w[layer], fmts[1], q_size, widths[1] // PANEL, per_task[1],
                             o_out, rows, it, blobs[it])
            cursor = _wait(ctr, base + 4, tasks, gate_up_w[layer], 0, _limit(gate_up_w[layer]))
            # 5. hidden += out; x = rms_norm(hidden), a token a task
            t, r = _claim(ctr, base + 5, tokens, it)
            while t < tokens:
                _add_row(hidden, o_out, widths[1], t)
                if not RMS_NORM(hidden[t:t + 1], post_norms[layer], eps, x[t:t + 1]):
                    _fail(ctr)
                _done(ctr, base + 5)
                t, r = _claim(ctr, base + 5, tokens, r)
            cursor = _wait(ctr, base + 5, tokens, gate_up_w[layer], cursor, _limit(gate_up_w[layer]))
            # 6. gate | up = x @ gate_up.T
            tasks = _product(ctr, base + 6, x_flat, gate_up_w[layer], fmts[2], hidden_size, widths[2] // PANEL,
                             per_task[2], gu_flat, rows, it, blobs[it])
            cursor = _wait(ctr, base + 6, tasks, down_w[layer], 0, _limit(down_w[layer]))
            # 7. g = silu(gate) * up, a token a task
            t, r = _claim(ctr, base + 7, tokens, it)
            while t < tokens:
                if not SILU_AND_MUL(gu[t:t + 1], g[t:t + 1]):
                    _fail(ctr)
                _done(ctr, base + 7)
                t, r = _claim(ctr, base + 7, tokens, r)
            cursor = _wait(ctr, base + 7, tokens, down_w[layer], cursor, _limit(down_w[layer]))
            # 8. out = g @ down.T
            tasks = _product(ctr, base + 8, g_flat, down_w[layer], fmts[3], ffn, widths[3] // PANEL, per_task[3], d_out,
                             rows, it, blobs[it])
            last = layer + 1 == num_layers
            # the next weight: the next qkv or the head (or none); two calls, their arrays two types
            if last:
                cursor = _wait(ctr, base + 8, tasks, head_w, 0, _limit(head_w) if with_head else 0)
            else:
                cursor = _wait(ctr, base + 8, tasks, qkv_w[layer + 1], 0, _limit(qkv_w[layer + 1]))
            # 9. hidden += out; the next layer's input norm (the last: the final norm, for the head)
            t, r = _claim(ctr, base + 9, tokens, it)
            while t < tokens:
                _add_row(hidden, d_out, widths[3], t)
                ok = True
                if not last:
                    ok = RMS_NORM(hidden[t:t + 1], input_norms[layer + 1], eps, x[t:t + 1])
                elif with_head:
                    ok = RMS_NORM(hidden[t:t + 1], final_norm, eps, x[t:t + 1])
                if not ok:
                    _fail(ctr)
                _done(ctr, base + 9)
                t, r = _claim(ctr, base + 9, tokens, r)
            if last:
                cursor = _wait(ctr, base + 9, tokens, head_w, cursor, _limit(head_w) if with_head else 0)
            else:
                cursor = _wait(ctr, base + 9, tokens, qkv_w[layer + 1], cursor, _limit(qkv_w[layer + 1]))
        # the LM head: logits = x @ head.T
        if with_head:
            phase = 1 + PHASES_PER_LAYER * num_layers
            tasks = _product(ctr, phase, x_flat, head_w, fmts[4], hidden_size, widths[4] // PANEL, per_task[4], logits,
                             rows, it, blobs[it])
            _wait(ctr, phase, tasks, head_w, 0, 0)


def compile_kernel(heads: int, cache: bool = CACHE, **kernels):
    """The kernel bound to the kernels its tasks call, given by ``ops.py``: ATTENTION (the register
    attention kernel's serial copy for ``heads`` query heads scored together), RMS_NORM, ROTARY,
    WRITE_KV, SILU_AND_MUL (serial copies) and MERGE, each ``guarded`` (a task that fails marks
    the step failed). Compiled on first use, cached on disk as ``_decode_layers_<heads>`` (with
    ``cache``: a kernel bound to other kernels, a test's, must not take the real one's place)."""
    fn = _decode_layers_body
    kernels = {name: guarded(kernel, CACHE) for name, kernel in kernels.items()}
    copy = types.FunctionType(fn.__code__, {**fn.__globals__, **kernels}, f"_decode_layers_{heads}",
                              fn.__defaults__, fn.__closure__)
    copy.__qualname__ = f"_decode_layers_{heads}"
    return njit(fastmath=True, parallel=True, cache=cache, error_model="numpy")(copy)


# --------------------------------------------------------------------------- the Python side

_NO_BOUNDS = np.zeros((1, 1, 1), np.float32)   # dense attention: no block bounds (keep = 0)
_NO_SCALES = np.ones((1, 1, 1), np.float32)    # a float32 pool: no scales


def usable(stack_: LayerStack | None, num_tokens: int, plan, kv_cache: np.ndarray, max_tokens: int) -> bool:
    """Whether this step can run as one persistent kernel: 1 to ``max_tokens`` tokens (as many
    as the layer-by-layer path multiplies on the panels), every one read by the paged attention
    kernel's work items (no prompt long enough for the prompt path), a stack of panels, a
    float32 pool laid out as the register attention kernel reads it."""
    return (stack_ is not None and 1 <= num_tokens <= max_tokens and len(plan.prompt_seqs) == 0
            and len(plan.items) > 0 and kv_cache.dtype == np.float32 and kv_cache.flags.c_contiguous
            and kv_cache.shape[-1] % LANES == 0)


def run(kernel, stack_: LayerStack, hidden: np.ndarray, positions: np.ndarray, kv_cache: np.ndarray,
        plan, scale: float, eps: float, cos: np.ndarray, sin: np.ndarray, num_heads: int,
        query_tile: int, num_threads: int, with_head: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
    """A step of T tokens through every layer with ``kernel`` (``compile_kernel``): hidden (T, h)
    the embeddings -> ((T, h) the last layer's output (before the final norm), and with
    ``with_head`` (the stack has a head) the (T, vocab) logits of every row, else None).
    kv_cache: (layers, 2, blocks, kv_heads, block_size, head_dim), the tokens' K and V are
    written at plan.meta.slot_mapping; query_tile: the attention kernel's tile (its partial
    sums' rows)."""
    with_head = bool(with_head and stack_.has_head)
    meta = plan.meta
    num_layers, hidden_size = stack_.input_norms.shape
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[5]
    widths = stack_.widths
    tokens = positions.shape[0]
    rows = padded_rows(tokens, bool(stack_.formats[0]))                     # as the panels take them
    padded = np.zeros((rows, hidden_size), np.float32)                      # (R, h), written in place
    padded[:tokens] = hidden
    x = np.zeros((rows, hidden_size), np.float32)                           # (R, h) a norm's output
    qkv_out = np.empty(rows * int(widths[0]), np.float32)                   # (R x padded q + 2 kv,)
    q = np.empty((tokens, num_heads, head_dim), np.float32)                 # (T, H, D)
    k = np.empty((tokens, num_kv_heads, head_dim), np.float32)              # (T, KVH, D)
    v = np.empty((tokens, num_kv_heads, head_dim), np.float32)              # (T, KVH, D)
    attn = np.zeros((rows, num_heads, head_dim), np.float32)                # (R, H, D), rows T.. zero
    o_out = np.empty(rows * int(widths[1]), np.float32)                     # (R x padded h,)
    gu = np.empty((rows, int(widths[2])), np.float32)                       # (R, padded 2 ffn)
    g = np.zeros((rows, stack_.ffn), np.float32)                            # (R, ffn), rows T.. zero
    d_out = np.empty(rows * int(widths[3]), np.float32)                     # (R x padded h,)
    slots = int(plan.merges[:, 3].sum()) if len(plan.merges) else 0
    part_rows = query_tile * num_heads
    part_acc = np.empty((slots, part_rows, head_dim), np.float32)           # (slots, rows, D)
    part_max = np.empty((slots, part_rows), np.float32)                     # (slots, rows)
    part_sum = np.empty((slots, part_rows), np.float32)                     # (slots, rows)
    strides = np.array([st // 4 for st in kv_cache.strides[2:5]], np.int64)  # block, head, token
    logits = np.empty(rows * int(widths[4]) if with_head else 0, np.float32)  # (R x padded vocab,)
    iterations = max(1, num_threads)
    rounded = max(hidden_size, num_heads * head_dim, stack_.ffn) if {Q4_1_A8, Q8_0_A8} & set(stack_.formats) else 0
    blobs = np.empty((iterations, rounded_size(rows, rounded)), np.float32)   # an iteration's x in int8
    ctr = np.zeros((3 + PHASES_PER_LAYER * num_layers, (iterations + 1) * LINE), np.int64)  # done / claimed; failed
    kernel(padded, x, x.reshape(-1), qkv_out, q, k, v, attn, attn.reshape(-1), o_out, gu, gu.reshape(-1),
           g, g.reshape(-1), d_out, stack_.input_norms, stack_.post_norms, stack_.qkv, stack_.o,
           stack_.gate_up, stack_.down, widths, stack_.per_task, stack_.formats, blobs, np.float32(eps),
           np.ascontiguousarray(positions, dtype=np.int64),
           np.ascontiguousarray(meta.slot_mapping, dtype=np.int64), kv_cache, cos, sin,
           meta.block_tables, meta.seq_lens, meta.query_start_loc, plan.items, plan.merges,
           np.float32(scale), part_acc, part_max, part_sum, strides, _NO_BOUNDS, _NO_SCALES,
           stack_.final_norm, stack_.head, logits, with_head, ctr, iterations)
    if ctr[-1, 0]:                               # a task failed: every thread left the region
        raise RuntimeError("the persistent decode kernel abandoned the step: one of its tasks failed (its attention's "
                           "scratch could not be allocated, say); the step's outputs are not used")
    if not np.isfinite(padded[:tokens]).all():   # no task raises (a waiting thread would poll for ever)
        raise FloatingPointError("the decode step's hidden states came out nan or inf after the layers: "
                                 "the model's weights or its inputs hold nan or inf values")
    if not with_head:
        return padded[:tokens], None
    # (T, vocab), contiguous as the layer-by-layer path's (the sampler's kernels read whole rows)
    return padded[:tokens], np.ascontiguousarray(logits.reshape(rows, -1)[:tokens, :stack_.vocab_size])
