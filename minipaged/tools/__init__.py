"""tools: instruments that measure and draw the engine; the engine never imports them.

    bench.py        ``python -m minipaged bench``: a workload, side by side where it compares settings
    workloads.py    the benchmark's seeded synthetic traces
    measure.py      runs a trace through an engine and times it (throughput, TTFT, TPOT, ITL)
    report.py       the tables, the memory workload's figures and its plot
    bench_peers.py  the Hugging Face transformers peer, in a child process
    bench_serve.py  ``bench serve``: streaming HTTP clients with Poisson arrivals against the server
    soak.py         the server under a bounded soak with faults: outcomes, latency percentiles, RSS, blocks held
    bounds.py       the machine's limits (matmul peak, integer peak, read bandwidth) and a step's
                    bytes and FLOPs: its bound, and a workload's floor
    roofline.py     ``bench roofline``: each decode and prefill step timed against its bound
                    (``bounds.py``), with where the time goes
    quality.py      ``bench quality``: perplexity and golden agreement for each kv_cache_dtype
    sparse_quality.py  ``bench sparse``: passkey retrieval, greedy agreement and teacher-forced
                    log-likelihood under block-sparse decode budgets, against dense
    spec_bench.py   ``bench spec-decode``: speculation off, n-gram and adaptive side by side
    structured_bench.py  ``bench structured``: free sampling against a JSON Schema, alternately, and
                    the schema's compile time
    parallel_bench.py  ``bench parallel``: one worker against pipeline stages and tensor-parallel
                    ranks, in this process and as Ray actors: time per step, and where it goes
    gpu_check.py    ``python -m minipaged.gpu_check``: every CUDA kernel checked and timed on a GPU,
                    then the engine end to end (``--smoke``: the same on the CPU harness)
    gpu_kernel_checks.py  gpu_check's kernel part: every CUDA kernel variant against its spec, and
                    the forward pass through the kernels against the dense reference
    gpu_preflight.py  before gpu_check measures: the versions, the preflight (the kernels compile,
                    Numba CUDA launches), the CPU kernels compiled
    viz.py          pictures of the KV pool and the page tables from real engine state (text, SVG)

They read the engine's state; like a profiler or ``top``, they sit above it.
"""
