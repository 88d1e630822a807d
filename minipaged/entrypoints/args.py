"""The engine and sampling flags every command shares, and what they turn into.

``chat``, ``generate`` and ``bench`` take the same engine flags, with vLLM's names
(``--block-size``, ``--max-num-seqs``, ...), so a command line moves between the two
projects unchanged. Here they are declared once and turned into ``LLMEngine``
keyword arguments and ``SamplingParams``; the commands themselves live in cli.py
(and the benchmark's in tools/bench.py).
"""

from __future__ import annotations

import argparse

from ..model.fetch import DEFAULT_MODEL, KNOWN_MODELS
from ..sampling_params import SamplingParams


def add_engine_flags(p: argparse.ArgumentParser, log_stats_interval: float = 5.0,
                     prefix_caching: bool = False, chunked_prefill: bool = False,
                     max_num_batched_tokens: int | None = None) -> None:
    """Engine flags. ``prefix_caching=True`` (chat) turns the page cache on unless the
    contiguous allocator, which has none, is chosen; ``chunked_prefill=True`` (serve) turns
    chunked prefill on, with ``max_num_batched_tokens`` the step's default token budget."""
    g = p.add_argument_group("engine")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=None if prefix_caching else False,   # None: on, unless contiguous
                   help="reuse the KV blocks of prompt prefixes seen before (default: "
                        f"{'on with the paged allocator' if prefix_caching else 'off'})")
    g.add_argument("--log-stats-interval", type=float, default=log_stats_interval, metavar="SECONDS",
                   help="print a stats line (throughput, queues, KV usage, preemptions) this often "
                        f"on stderr; 0 turns it off (default {log_stats_interval:g})")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"a known model name ({', '.join(KNOWN_MODELS)}) or a Hugging Face "
                        "Llama directory (config.json, *.safetensors, tokenizer.json)")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where to run: 'auto' picks a CUDA GPU if CuPy sees one, else the CPU")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="weight and KV cache dtype ('auto': float32 on the CPU; on a GPU bfloat16 for a bf16 "
                        "checkpoint, else float16); on the CPU bfloat16 stores the weights in half the bytes, "
                        "computing in float32 (the KV cache stays float32 there)")
    g.add_argument("--quantization", default=None, choices=["int8", "gguf", "gguf_a8"],
                   help="CPU weights in fewer bytes: int8 (a scale per output row), or gguf (the model's GGUF "
                        "file's own Q4_1 / Q8_0 blocks); activations stay float32, but gguf_a8's products "
                        "read x rounded to int8 a block of 32, as llama.cpp's do (docs/weights.md)")
    g.add_argument("--block-size", type=int, default=16,
                   help="tokens per KV block (a power of two); the page size of the KV cache")
    g.add_argument("--num-blocks", type=int, default=None,
                   help="number of KV blocks in the pool (overrides --kv-cache-space)")
    g.add_argument("--kv-cache-space", type=float, default=None,
                   help="KV pool size in GiB on the CPU (default 4); shared by the workers of a split "
                        "under uni, each Ray worker's own under ray")
    g.add_argument("--max-num-seqs", type=int, default=256,
                   help="most sequences running in one batch")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's context length)")
    p.set_defaults(chunked_prefill_budget=max_num_batched_tokens)   # used only with chunked prefill on
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help=f"token budget of one step (default: {max_num_batched_tokens} with chunked prefill, else "
                        "max(2048, max_num_seqs, max_model_len))" if max_num_batched_tokens is not None else
                        "token budget of one step (default: max(2048, max_num_seqs, max_model_len); "
                        "with chunked prefill max(2048, max_num_seqs))")
    g.add_argument("--swap-space", type=float, default=4.0,
                   help="GiB of CPU memory for KV blocks swapped out by preemption")
    g.add_argument("--preemption-mode", default="auto", choices=["auto", "swap", "recompute", "partial"],
                   help="how a preempted request gives its blocks back: swap them to CPU memory, "
                        "drop them and recompute later, auto (swap unless short or the swap "
                        "space is full), or partial (demand paging: swap out only the blocks the "
                        "step lacks, its tail first)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=chunked_prefill,
                   help="split long prompts into chunks that share steps with running decodes "
                        f"(default {'on' if chunked_prefill else 'off'})")
    g.add_argument("--num-scheduler-steps", type=int, default=1,
                   help="decode steps run per scheduling decision (multi-step scheduling)")
    g.add_argument("--kv-allocator", default="paged", choices=["paged", "contiguous"],
                   help="paged (PagedAttention) or the contiguous baseline: one run of blocks reserved "
                        "per request at admission, as systems before vLLM did")
    g.add_argument("--contiguous-reserve", default="max_model_len", choices=["max_model_len", "max_tokens"],
                   help="what the contiguous baseline reserves: max_model_len slots, or prompt + max_tokens")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2"],
                   help="how KV blocks are stored: auto (the compute dtype: float32 on the CPU), int8 (a "
                        "scale per token and head), fp8 = fp8_e4m3 or fp8_e5m2 (a scale per layer); one byte a value")
    g.add_argument("--calculate-kv-scales", action=argparse.BooleanOptionalAction, default=False,
                   help="fp8 KV cache: per-layer K and V scales from the first step's values "
                        "(max / 200 and max / 100, as vLLM) instead of 1.0")
    g.add_argument("--sparse-attention-budget", type=int, default=None, metavar="TOKENS",
                   help="block-sparse decode attention (Quest): each head attends to the blocks, within "
                        "this many tokens, whose keys could score highest (the first and last always); "
                        "prefill stays dense. Default: dense")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4, "prompt_lookup_min": 1, "adaptive": true}')
    g.add_argument("-tp", "--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="workers splitting every layer by heads and MLP columns (docs/distributed.md)")
    g.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1, metavar="N",
                   help="pipeline stages, each holding a contiguous run of layers")
    g.add_argument("--distributed-executor-backend", default="uni", choices=["uni", "ray"],
                   help="uni: every worker in this process; ray: each worker a Ray actor "
                        "(pip install 'minipaged[distributed]')")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="GPU: share of the device's memory for weights, activations and the KV cache")
    g.add_argument("--cpu-gemm", default="auto", choices=["auto", "mkl", "numba"],
                   help="the CPU's linear layers: oneMKL's packed GEMM (pip install 'minipaged[mkl]') or "
                        "minipaged's Numba kernels (decode steps on each weight's panels, made at load) and numpy's "
                        "BLAS; auto, with oneMKL installed, times both once per machine and model shape and gives "
                        "each kind of step (single-stream decode, batched decode, prefill) the faster")
    g.add_argument("--kernels", default=None, choices=["fast", "simple"],
                   help="the CPU's tier of kernels (kernels/ops.py): fast (registers, panels, oneMKL, one persistent "
                        "decode kernel: kernels/fast/) or simple (one readable function per operation: "
                        "kernels/simple.py, the one to read and change first); default $MINIPAGED_KERNELS, else "
                        "fast; a GPU runs the CUDA kernels")
    g.add_argument("--seed", type=int, default=0, help="seed for requests that bring none")
    g.add_argument("--max-logprobs", type=int, default=20,
                   help="most log-probabilities a request may ask for per token (-1: no cap)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(model=args.model, device=args.device, dtype=args.dtype, quantization=args.quantization,
                block_size=args.block_size,
                num_blocks=args.num_blocks, kv_cache_space=args.kv_cache_space,
                max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                max_num_batched_tokens=(args.max_num_batched_tokens if args.max_num_batched_tokens is not None
                                        else max(args.chunked_prefill_budget, args.max_num_seqs)
                                        if args.enable_chunked_prefill and args.chunked_prefill_budget else None),
                swap_space=args.swap_space,
                preemption_mode=args.preemption_mode,
                enable_chunked_prefill=args.enable_chunked_prefill,
                num_scheduler_steps=args.num_scheduler_steps, seed=args.seed,
                log_stats_interval=args.log_stats_interval,
                enable_prefix_caching=(args.kv_allocator == "paged" if args.enable_prefix_caching is None
                                       else args.enable_prefix_caching),
                gpu_memory_utilization=args.gpu_memory_utilization,
                kv_allocator=args.kv_allocator, contiguous_reserve=args.contiguous_reserve,
                max_logprobs=args.max_logprobs, kv_cache_dtype=args.kv_cache_dtype,
                calculate_kv_scales=args.calculate_kv_scales,
                sparse_attention_budget=args.sparse_attention_budget,
                speculative_config=args.speculative_config,
                tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
                distributed_executor_backend=args.distributed_executor_backend, cpu_gemm=args.cpu_gemm,
                kernels=args.kernels)


def add_sampling_flags(p: argparse.ArgumentParser, *, max_tokens: int, temperature: float,
                       top_p: float, repetition_penalty: float = 1.0, model_defaults: bool = False) -> None:
    """Sampling flags with vLLM's names. Their argparse default is None (= not given), so
    ``sampling_params`` can tell a flag the user passed from one the command fills in; the
    command's own defaults travel in ``args.sampling_defaults``. ``model_defaults``: the
    command fills in the model's generation_config.json values first (chat), and says so."""
    defaults = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=-1, min_p=0.0,
                    presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=repetition_penalty)
    p.set_defaults(sampling_defaults=defaults)
    note = ("a flag not given takes the value the model's generation_config.json recommends, if it sets "
            "one, else the default shown" if model_defaults else None)
    g = p.add_argument_group("sampling", description=note)
    g.add_argument("--max-tokens", type=int, default=None,
                   help=f"most new tokens per answer (default {max_tokens})")
    g.add_argument("--temperature", type=float, default=None, help=f"0 means greedy (default {temperature:g})")
    g.add_argument("--top-p", type=float, default=None, help=f"nucleus sampling mass (1 = off; default {top_p:g})")
    g.add_argument("--top-k", type=int, default=None, help="sample among the k most likely (-1 = off, the default)")
    g.add_argument("--min-p", type=float, default=None,
                   help="drop tokens below min_p x the top probability (default 0)")
    g.add_argument("--presence-penalty", type=float, default=None,
                   help="subtract this from the logit of every token already generated, in [-2, 2] (default 0)")
    g.add_argument("--frequency-penalty", type=float, default=None,
                   help="subtract this times the token's count so far in the output, in [-2, 2] (default 0)")
    g.add_argument("--repetition-penalty", type=float, default=None,
                   help="> 1 discourages tokens already in the prompt or output, < 1 favours them "
                        f"(1 = off; default {repetition_penalty:g})")
    g.add_argument("--sampling-seed", type=int, default=None, help="seed of each request's sampler")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-text token")


def sampling_values(args: argparse.Namespace, model_defaults: dict | None = None) -> tuple[dict, dict]:
    """Each sampling flag's value: the user's flag, else the model's recommendation
    (``model_defaults``: LLMEngine.generation_defaults, from generation_config.json), else the
    command's own default. Returns (all values, those that came from the model)."""
    values, from_model = {}, {}
    for name, builtin in args.sampling_defaults.items():
        given = getattr(args, name)
        if given is not None:
            values[name] = given
        elif model_defaults and name in model_defaults:
            values[name] = from_model[name] = model_defaults[name]
        else:
            values[name] = builtin
    return values, from_model


def sampling_params(args: argparse.Namespace, model_defaults: dict | None = None, **extra) -> SamplingParams:
    """The request's SamplingParams (see sampling_values for where each value comes from).
    A value from the model's generation_config.json that SamplingParams refuses is named as such."""
    values, from_model = sampling_values(args, model_defaults)
    try:
        return SamplingParams(**values, seed=args.sampling_seed, ignore_eos=args.ignore_eos, **extra)
    except ValueError as err:
        blamed = [name for name in from_model if str(err).startswith(f"invalid SamplingParams: {name} ")]
        if not blamed:
            raise
        raise ValueError(f"{err} (the model's generation_config.json set {blamed[0]}={from_model[blamed[0]]!r}; "
                         "pass the flag to override it)") from None
