"""minipaged: a from-scratch LLM inference engine that implements vLLM's PagedAttention.

    from minipaged import LLM, SamplingParams
    llm = LLM()                                   # SmolLM2-135M-Instruct, fetched on first use
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=32))
    print(out[0].outputs[0].text)

The package is laid out as the operating system it mirrors (docs/architecture.md):

    memory/       the virtual-memory manager: frames, page tables, the page cache
    scheduler/    the process scheduler: FCFS queues, budgets, preemption
    engine/       the main loop and the machinery it drives (model runner, cache, sampler)
    entrypoints/  the front doors: the command line, chat, the OpenAI-compatible server
    tools/        instruments that measure and draw the engine (bench, gpu_check, viz)
    model/        the process image: the Llama transformer, weights, tokenizer
    kernels/      the hardware: paged attention, KV writes, block copies

and at this level the vocabulary they all share: ``config``, ``sampling_params``,
``outputs``, ``sequence``, plus ``boot`` (set up before numpy loads).
"""

from . import boot  # noqa: F401  (first: thread settings must precede numpy's import)
from .engine.async_llm_engine import AsyncLLMEngine
from .engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from .engine.llm import LLM
from .engine.llm_engine import LLMEngine
from .engine.input_processor import RequestError
from .engine.parallel.worker import WorkerError
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import OutputKind, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "LLMEngine", "AsyncLLMEngine", "SamplingParams", "StructuredOutputsParams", "OutputKind",
           "RequestOutput", "CompletionOutput", "RequestError", "WorkerError", "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence"]
__version__ = "0.1.0"
