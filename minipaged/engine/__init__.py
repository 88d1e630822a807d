"""engine: the main loop (the OS kernel's) and the machinery it drives each step.

    llm_engine.py        LLMEngine: add_request / step / abort_request / get_stats, the main loop
    llm.py               LLM: generate / chat / beam_search, vLLM's offline API over one LLMEngine
    async_llm_engine.py  AsyncLLMEngine: one engine loop shared by many concurrent callers (the server's)
    warm_up.py           paging in the hot code at boot: dummy forward passes before the first request
    liveness.py          the hung-task watchdog's trace: each step's heartbeat and the stats copied
                         between steps, read by /health and /stats without waiting on the engine
    input_processor.py   a request checked in full before it is queued (exec()'s checks): RequestError
    backend.py           the hardware abstraction layer: picks the device and the kernel namespace
    linear_calibration.py  the boot-time benchmark: each kind of step's linear-layer engine (ours
                         or oneMKL's) timed once per machine and model shape, kept on disk
    thread_pools.py      BLAS's and Numba's thread pools told to yield the cores to each other,
                         whatever was imported first
    cache_engine.py      physical memory and swap space: owns the KV pool and the CPU swap pool,
                         executes the memory manager's copy and swap plans (the DMA driver)
    model_runner.py      loads the page-table base registers: one step flattened into arrays
                         and AttentionMetadata, then the model's forward pass
    sampler.py           next tokens: greedy, temperature, top-k / top-p / min-p, seeds, logprobs
    beam_search.py       beams as forked processes: proposals, ranking, fork the survivors, free the rest
    detokenizer.py       incremental detokenization: text grows token by token
    output_processor.py  stop rules and RequestOutputs (the system call's return values)
    metrics.py           the counters behind get_stats() and the periodic log line (top)
    spec_decode.py       speculative execution: draft lengths and n-gram drafts, verification,
                         the adaptive rule and the counters
    ngram_proposer.py    readahead for tokens: prompt-lookup drafts
    rejection_sampler.py retiring speculated work: greedy checks and the exact rejection rule
    draft_model.py       a draft model, its own KV pool under the target's block ids
    worker.py            one processor and its local memory: a model shard and the KV pool of its
                         heads and layers, under the driver's one set of block ids
    executor.py          inter-processor calls: one step carried to every worker; ``uni`` runs them
                         in this process, their all-reduces a sum in lock step
    ray_executor.py      workers as Ray actors: pipeline stages pass hidden states as Ray objects,
                         tensor-parallel GPUs all-reduce over NCCL

It drives the scheduler (scheduler/) and the memory manager (memory/) below it, and the
model (model/) and the kernels (kernels/) through the backend's kernel namespace.
"""
