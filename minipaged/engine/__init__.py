"""engine: the main loop (the OS kernel's) and the machinery it drives each step.

    llm_engine.py        LLMEngine: add_request / step / abort_request / get_stats, the main loop
    llm.py               LLM: generate / chat / beam_search, vLLM's offline API over one LLMEngine
    async_llm_engine.py  AsyncLLMEngine: one engine loop shared by many concurrent callers (the server's)
    warm_up.py           paging in the hot code at boot: dummy forward passes before the first request
    liveness.py          the hung-task watchdog's trace: each step's heartbeat and the stats copied
                         between steps, read by /health and /stats without waiting on the engine
    input_processor.py   a request checked in full before it is queued (exec()'s checks): RequestError
    backend.py           the hardware abstraction layer: picks the device and the tier of kernels
                         (kernels/ops.py: the plain tier, the fast tier, CUDA's)
    linear_calibration.py  the boot-time benchmark: each kind of step's linear-layer engine (ours
                         or oneMKL's) timed once per machine and model shape, kept on disk
    cache_engine.py      physical memory and swap space: owns the KV pool and the CPU swap pool,
                         executes the memory manager's copy and swap plans (the DMA driver)
    model_runner.py      loads the page-table base registers: one step flattened into arrays
                         and AttentionMetadata, then the model's forward pass
    sampler.py           next tokens: greedy, temperature, top-k / top-p / min-p, seeds, logprobs
    structured_output.py a grammar per sequence (JSON Schema, regex, choice, CFG through llguidance)
                         and the batch's token masks: the protection bits checked on every token
    beam_search.py       beams as forked processes: proposals, ranking, fork the survivors, free the rest
    detokenizer.py       incremental detokenization: text grows token by token
    output_processor.py  stop rules and RequestOutputs (the system call's return values)
    metrics.py           the counters behind get_stats() and the periodic log line (top)
    spec_decode/         speculative execution: draft lengths, n-gram and draft-model drafts, the
                         verification of a step's rows, the rollback of the rejected ones
    parallel/            the workers (model shards and their pools) and the executors that carry
                         each step to them (uni, ray)

It drives the scheduler (scheduler/) and the memory manager (memory/) below it, and the
model (model/) and the kernels (kernels/) through the tier of kernels the backend chose.
"""
