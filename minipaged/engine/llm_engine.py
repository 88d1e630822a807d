"""LLMEngine: the kernel's main loop. Admit requests, schedule, run, sample, report.

One ``step()`` is one trip round this data flow (docs/architecture.md, "One engine step")::

    Scheduler.schedule()  -> which sequences run and how many tokens each
    Executor              -> every worker moves the planned blocks, writes new K/V into
                             their slots, runs paged attention; logits (executor.py)
    Sampler               -> next tokens
    OutputProcessor       -> text, stop rules; finished sequences free their blocks

Requests are checked before they are queued by the InputProcessor (input_processor.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time

import numpy as np

from ..config import (CacheConfig, ConfigError, EngineConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig,
                      default_kernels)
from ..memory.block_manager import BlockManager
from ..memory.contiguous_allocator import ContiguousBlockManager
from ..memory.fragmentation import KVBreakdown, measure, summarize
from ..kernels.fast.tuning import DEFAULT_TUNING, FastTuning
from ..model.config import LlamaConfig, read_generation_defaults
from ..model.fetch import DEFAULT_MODEL, resolve_model
from ..model.tokenizer import Tokenizer
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams, derive_seed
from ..scheduler.scheduler import Scheduler
from ..sequence import SequenceGroup
from .backend import select_backend, without_block_copies
from .beam_search import BeamSearchParams, advance_beams
from .spec_decode.draft_model import DraftModel, load_draft_config
from .parallel.executor import check_executor, make_executor
from .input_processor import InputProcessor, PromptInput, RequestError
from .linear_calibration import settle_linear_paths
from .metrics import Metrics
from .model_runner import build_model_input
from .output_processor import OutputProcessor
from .sampler import Sampler, SampleRequest, log_softmax, to_host
from .spec_decode.decoder import SpeculativeDecoder
from .structured_output import GrammarCompiler

logger = logging.getLogger("minipaged")


class LLMEngine:
    def __init__(self, model: str = DEFAULT_MODEL, *, device: str = "auto", dtype: str = "auto",
                 block_size: int = 16, num_blocks: int | None = None,
                 kv_cache_space: float | None = None, max_num_seqs: int = 256,
                 max_model_len: int | None = None, max_num_batched_tokens: int | None = None,
                 swap_space: float = 4.0, preemption_mode: str = "auto",
                 enable_chunked_prefill: bool = False, num_scheduler_steps: int = 1,
                 enable_prefix_caching: bool = False, gpu_memory_utilization: float = 0.9,
                 kv_allocator: str = "paged", contiguous_reserve: str = "max_model_len",
                 track_fragmentation: bool = False, kv_cache_dtype: str = "auto",
                 calculate_kv_scales: bool = False, sparse_attention_budget: int | None = None,
                 speculative_config=None, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                 distributed_executor_backend: str = "uni", seed: int = 0, log_stats_interval: float = 0.0,
                 max_logprobs: int = 20, cpu_gemm: str = "auto", kernels: str | None = None,
                 fast_tuning: FastTuning = DEFAULT_TUNING, quantization: str | None = None) -> None:
        self.config = EngineConfig(model=str(model), device=device, dtype=dtype, seed=seed,
                                   max_logprobs=max_logprobs, cpu_gemm=cpu_gemm,
                                   kernels=default_kernels() if kernels is None else kernels, quantization=quantization)
        if not isinstance(fast_tuning, FastTuning):
            raise ConfigError(f"fast_tuning must be a FastTuning (kernels/fast/tuning.py), got {type(fast_tuning).__name__}")
        cache_config = CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                   kv_cache_space=kv_cache_space, swap_space=swap_space,
                                   gpu_memory_utilization=gpu_memory_utilization,
                                   kv_cache_dtype=kv_cache_dtype, calculate_kv_scales=calculate_kv_scales,
                                   sparse_attention_budget=sparse_attention_budget)
        self.parallel_config = ParallelConfig(tensor_parallel_size, pipeline_parallel_size,
                                              distributed_executor_backend)
        # Settings that need no model are checked before the (slow) load.
        if calculate_kv_scales and tensor_parallel_size > 1:
            raise ConfigError("calculate_kv_scales with tensor_parallel_size > 1: each rank would scale its "
                              "heads from what only it sees, and the ranks' scales would differ; use fp8's "
                              "default scales (calculate_kv_scales=False) or tensor_parallel_size=1")
        if kv_allocator not in ("paged", "contiguous"):
            raise ConfigError(f"kv_allocator must be 'paged' or 'contiguous', got {kv_allocator!r}")
        if contiguous_reserve not in ("max_model_len", "max_tokens"):
            raise ConfigError(f"contiguous_reserve must be 'max_model_len' or 'max_tokens', "
                              f"got {contiguous_reserve!r}")
        if kv_allocator == "contiguous" and enable_prefix_caching:
            raise ConfigError("prefix caching needs the paged allocator (kv_allocator='paged'); "
                              "turn one of them off")
        if kv_allocator == "contiguous":   # it never preempts: a swap pool would sit unused
            cache_config = dataclasses.replace(cache_config, swap_space=0)
        self.speculative_config = SpeculativeConfig.from_value(speculative_config)
        if self.speculative_config is not None:
            if num_scheduler_steps != 1:
                raise ConfigError("speculative decoding and multi-step scheduling (num_scheduler_steps="
                                  f"{num_scheduler_steps}) do not combine; use one of them")
            if kv_allocator != "paged":
                raise ConfigError("speculative decoding needs the paged allocator (kv_allocator='paged'): "
                                  "rejected drafts are rolled back block by block")
            if sparse_attention_budget is not None:
                raise ConfigError("speculative decoding and sparse_attention_budget do not combine: a "
                                  "verification pass attends densely where a decode would attend sparsely, "
                                  "so the tokens would differ from a run without speculation; use one of them")
        if not (isinstance(log_stats_interval, (int, float)) and log_stats_interval >= 0):
            raise ConfigError(f"log_stats_interval must be a number of seconds >= 0 (0: never), "
                              f"got {log_stats_interval!r}")
        self.model_dir = model_dir = resolve_model(self.config.model)
        self.model_config = LlamaConfig.from_dir(model_dir)
        c = self.model_config   # the split is checked against config.json, before any weight is read
        if any(c.layer_windows) and sparse_attention_budget is not None:
            raise ConfigError("sparse_attention_budget and a sliding-window model do not combine: "
                              "block-sparse decode reads whole blocks the window would cut")
        self.parallel_config.check_model(num_attention_heads=c.num_attention_heads,
                                         num_key_value_heads=c.num_key_value_heads,
                                         intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers)
        # What the model's generation_config.json recommends (only the keys it sets, under
        # SamplingParams' names): the chat command and the server start from these.
        self.generation_defaults: dict = read_generation_defaults(model_dir)
        max_pos = self.model_config.max_position_embeddings
        if max_model_len is not None and not (isinstance(max_model_len, int) and max_model_len > 0):
            raise ConfigError(f"max_model_len must be a positive integer, got {max_model_len!r}")
        if max_model_len is not None and max_model_len > max_pos:
            raise ConfigError(f"max_model_len={max_model_len} exceeds the model's "
                             f"max_position_embeddings={max_pos}")
        self.scheduler_config = SchedulerConfig(
            max_model_len=max_pos if max_model_len is None else max_model_len,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=enable_chunked_prefill, preemption_mode=preemption_mode,
            num_scheduler_steps=num_scheduler_steps)
        self.max_model_len = self.scheduler_config.max_model_len
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.backend = select_backend(self.config.device, self.config.dtype, self.config.cpu_gemm,
                                      kernels=self.config.kernels, tuning=fast_tuning, checkpoint_dtype=c.torch_dtype,
                                      quantization=self.config.quantization)
        check_executor(self.parallel_config, self.backend.device)
        # a GPU without Numba CUDA: no swap space, and no request that forks (n > 1, beams)
        copy_problem = self.backend.block_copy_problem()
        cache_config = without_block_copies(cache_config, copy_problem, preemption_mode)
        # cpu_gemm="auto" with oneMKL: each kind of step's engine, timed once a machine and model shape
        self.backend = settle_linear_paths(self.backend, self.model_config, model_dir)
        draft = None      # (directory, config) of a draft model, checked before anything loads
        if self.speculative_config is not None and self.speculative_config.method == "draft_model":
            draft = load_draft_config(self.speculative_config.model, self.model_config, self.tokenizer,
                                      self.max_model_len)
        # a draft model is loaded before the pool is sized (its weights take memory too), and its
        # pool is indexed by the same block ids: each block costs both pools' bytes
        self.draft = (DraftModel(draft[0], draft[1], self.backend, self.max_model_len,
                                 self.scheduler_config.max_num_batched_tokens) if draft else None)
        draft_bytes = DraftModel.bytes_per_block(draft[1], cache_config, self.backend.dtype) if draft else 0
        # The workers: each loads its shard and allocates its pool, all with the same block count
        self.executor = make_executor(
            model_dir, self.model_config, cache_config, self.parallel_config, self.backend, self.max_model_len,
            self.scheduler_config.max_num_batched_tokens,
            extra_models=[(self.draft.model, draft[1])] if draft else (), extra_bytes_per_block=draft_bytes)
        # The driver's own worker, when the workers live in this process (uni): the whole model
        # when nothing is split, so tools and tutorials can reach the model and its pool.
        driver = getattr(self.executor, "driver_worker", None)
        self.model = driver.model if driver else None
        self.cache = driver.cache if driver else None
        self.runner = driver.runner if driver else None
        if self.draft is not None:
            self.draft.attach_pool(cache_config, self.executor.num_blocks, self.executor.num_cpu_blocks)
        if kv_allocator == "contiguous":   # the "traditional" baseline of the paper
            self.block_manager = ContiguousBlockManager(self.executor.num_blocks, block_size, self.max_model_len,
                                                        reserve=contiguous_reserve)
        else:
            # blocks slide out of the window as the sequences run; not under a draft model, which
            # writes its own K/V of the same blocks later, catching up from where it stopped
            window = 0 if draft else c.sliding_window
            self.block_manager = BlockManager(self.executor.num_blocks, block_size, self.executor.num_cpu_blocks,
                                              watermark=cache_config.watermark,
                                              enable_prefix_caching=enable_prefix_caching, sliding_window=window)
        self.kv_allocator = kv_allocator
        self.track_fragmentation = track_fragmentation
        self.kv_history: list[KVBreakdown] = []   # one per step, if track_fragmentation
        self.scheduler = Scheduler(self.scheduler_config, self.block_manager)
        # the CPU kernels have a fused row normaliser; on a GPU the sampler uses CuPy's reductions
        self.sampler = Sampler(self.backend.xp, getattr(self.backend.ops, "logsumexp", None))
        eos = set(self.tokenizer.stop_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer, eos, self.max_model_len)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, eos)   # structured outputs
        self.input_processor = InputProcessor(self.tokenizer, self.model_config.vocab_size,
                                              self.max_model_len, self.block_manager, kv_allocator,
                                              max_logprobs=self.config.max_logprobs,
                                              max_num_seqs=self.scheduler_config.max_num_seqs,
                                              block_copy_problem=copy_problem, grammars=self.grammars)
        self.metrics = Metrics()
        self.spec = (SpeculativeDecoder(self.speculative_config, self.max_model_len, self.draft)
                     if self.speculative_config is not None else None)
        self.log_stats_interval = log_stats_interval   # seconds between log lines; 0 = never
        self._last_log_time = time.monotonic()
        self.rng = np.random.default_rng(seed)        # seeds requests that bring no seed of their own
        self.groups: dict[str, SequenceGroup] = {}     # unfinished requests by id
        self.generators: dict[int, np.random.Generator] = {}  # seq_id -> its random stream
        self._seq_ids = itertools.count()

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt) -> PromptInput:
        """Accept a str, a list of token ids, or {"prompt": str} / {"prompt_token_ids": [...]}."""
        return self.input_processor.tokenize(prompt)

    def _make_group(self, request_id: str, prompt, params: SamplingParams | None) -> SequenceGroup:
        """Validate and build a request without queueing it; raises RequestError."""
        self._check_new_id(request_id)
        return self.input_processor.make_group(request_id, prompt, params, self._seq_ids)

    def _make_beam_group(self, request_id: str, prompt, params: BeamSearchParams) -> SequenceGroup:
        """A beam search starts as one sequence; beams fork from it after the prompt."""
        self._check_new_id(request_id)
        return self.input_processor.make_beam_group(request_id, prompt, params, self._seq_ids)

    def _check_new_id(self, request_id: str) -> None:
        if request_id in self.groups:
            raise RequestError(f"request id {request_id!r} is already in use")

    def _queue(self, group: SequenceGroup) -> None:
        seed = group.sampling_params.seed
        if seed is None:
            seed = int(self.rng.integers(2**63))
        for index, seq in enumerate(group.seqs):  # each sample its own stream (see derive_seed)
            self.generators[seq.seq_id] = np.random.default_rng(derive_seed(seed, index))
        self.groups[group.request_id] = group
        self.scheduler.add_seq_group(group)

    def add_beam_request(self, request_id: str, prompt, params: BeamSearchParams) -> None:
        """Queue a beam search; it reports once, when done, with beam_width ranked outputs."""
        self._queue(self._make_beam_group(str(request_id), prompt, params))

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None) -> None:
        """Queue a request (FCFS). Bad input raises RequestError and changes nothing."""
        self._queue(self._make_group(str(request_id), prompt, params))

    def abort_request(self, request_id: str) -> None:
        """Cancel a request in any state; its blocks are free when this returns."""
        group = self.scheduler.abort_seq_group(str(request_id))
        if group is not None:
            self._forget(group)

    def shutdown(self) -> None:
        """Stop the workers now (Ray actors exit); their executor also does it when it is
        collected with this engine, and at exit."""
        self.executor.shutdown()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_seqs()

    def _forget(self, group: SequenceGroup) -> None:
        self.groups.pop(group.request_id, None)
        self.output_processor.forget(group)
        for seq in group.seqs:
            self.generators.pop(seq.seq_id, None)
            if self.spec is not None:
                self.spec.forget(seq.seq_id)

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        if self.spec is not None:   # draft tokens for the decodes, before their slots are mapped
            running = self.scheduler.running
            self.spec.propose(running, [s for g in running for s in self.scheduler.decoding_seqs(g)])
        plan = self.scheduler.schedule()
        # One plan for every pool the block ids index: every worker's, and a draft model's.
        moves = plan.blocks_to_swap_out, plan.blocks_to_swap_in, plan.blocks_to_copy
        if any(moves):
            self.executor.move_blocks(*moves)
            if self.draft is not None:
                self.draft.cache.move(*moves)
        if plan.is_empty:
            return []
        blocks_in_use = self.block_manager.num_used_blocks                 # before anything is freed
        blocks_mapped = self.block_manager.num_mapped_blocks
        self.metrics.max_concurrent_requests = max(self.metrics.max_concurrent_requests,
                                                   len(self.scheduler.running))
        if self.track_fragmentation:
            self.kv_history.append(measure(self.block_manager, self.scheduler, self.max_model_len))
        touched: dict[str, SequenceGroup] = {}
        items = plan.scheduled
        num_generated = self._run_model(items, touched)
        for _ in range(plan.num_steps - 1):  # multi-step: more decodes on slots reserved ahead
            items = [dataclasses.replace(i, num_new_tokens=1) for i in items if not i.seq.is_finished()]
            if not items:
                break
            num_generated += self._run_model(items, touched)
        if self.spec is not None:
            self.spec.observe([i.seq for i in plan.scheduled])
        now = time.monotonic()
        for group in touched.values():
            if group.is_finished():
                group.finished_time = now
                for seq in group.seqs:
                    self.metrics.record_finished(group.first_token_time, now, seq.num_output_tokens)
        outputs = [self.output_processor.make_output(g) for g in touched.values()]
        for group in self.scheduler.free_finished():
            self._forget(group)
        num_prompt = sum(s.num_new_tokens for s in plan.scheduled if s.is_prefill)
        self.metrics.record_step(blocks_in_use, blocks_mapped, num_prompt, num_generated)
        if self.log_stats_interval and now - self._last_log_time >= self.log_stats_interval:
            self._last_log_time = now
            logger.info(self.metrics.log_line(self.get_stats()))
        return [o for o in outputs if o is not None]

    def _run_model(self, items: list, touched: dict[str, SequenceGroup]) -> int:
        """One forward pass over ``items``, then sample; returns how many tokens were sampled."""
        tables = [self.block_manager.block_table(s.seq) for s in items]
        banned_of = self.output_processor.banned_tokens
        # seq_id -> a draft model's distributions (k, V): it fills in the drafts' tokens now
        draft_probs = (self.spec.fill_drafts(items, tables, self.block_manager.block_size, self.sampler,
                                             self.generators, banned_of) if self.spec is not None else {})
        # request -> the first prompt position still needing logits (prompt_logprobs)
        prompt_from = {i.group.request_id: start for i in items if i.is_prefill
                       and (start := self.output_processor.prompt_logprobs_from(i.group)) is not None}
        model_input = build_model_input(items, tables, self.block_manager.block_size, prompt_from)
        logits = self.executor.execute_model(model_input.forward_input())   # (N + V + M, vocab)
        rows = list(range(len(model_input.sampled)))
        beam_rows = [r for r in rows if model_input.sampled[r][0].group.beam is not None]
        sample_rows = [r for r in rows if model_input.sampled[r][0].group.beam is None]
        sampled = [model_input.sampled[r] for r in sample_rows]
        masks = self.grammars.masks_for([seq.grammar for _, seq in sampled])   # structured outputs
        requests = [SampleRequest(item.group.sampling_params, self.generators[seq.seq_id],
                                  self.output_processor.banned_tokens(item.group, seq),
                                  seq.prompt_token_ids, seq.output_token_ids, mask)
                    for (item, seq), mask in zip(sampled, masks)]
        # the sampled rows come first: all of them (no beams) are a view, not a gathered copy
        sampled_logits = logits[:len(rows)] if len(sample_rows) == len(rows) else logits[sample_rows]
        results = self.sampler(sampled_logits, requests)
        beam_logprobs = to_host(log_softmax(logits[beam_rows].astype(np.float64), self.backend.xp))  # (beams, vocab)
        offset = len(model_input.sampled)           # the speculating rows follow the sampled ones
        verdicts = []                               # (item, drafts that stood, results to append)
        if model_input.verify:
            verdicts, offset = self.spec.verify_rows(logits, offset, model_input.verify, self.sampler,
                                                     self.generators, banned_of, draft_probs)
        prompt_results = []                         # the prompt rows come last
        for run in model_input.prompt_rows:
            m = run.token_ids.shape[0]
            prompt_results.append(self.sampler.prompt_logprobs(
                logits[offset:offset + m], run.token_ids, run.group.sampling_params.prompt_logprobs))
            offset += m
        # Only now does the step change sequences: if anything above raised (or was
        # interrupted), the same sequences are simply scheduled again next step.
        for run, entries in zip(model_input.prompt_rows, prompt_results):
            self.output_processor.add_prompt_logprobs(run.group, run.first_token, entries)
        for item in items:
            # a speculating decode keeps its newest token and the drafts that stood
            item.seq.num_computed_tokens += item.num_new_tokens - len(item.draft_token_ids)
            for follower in item.followers:   # they share the prompt's blocks: same progress
                follower.num_computed_tokens = item.seq.num_computed_tokens
        now = time.monotonic()
        for (item, seq), result in zip(sampled, results):
            self.output_processor.append(item.group, seq, result)
            touched[item.group.request_id] = item.group
        num_emitted = (self.spec.commit(verdicts, self.output_processor.append, self.block_manager, touched)
                       if verdicts else 0)
        beams: dict[str, list] = {}                                      # request -> [(seq, row)]
        for i, r in enumerate(beam_rows):
            item, seq = model_input.sampled[r]
            beams.setdefault(item.group.request_id, []).append((seq, beam_logprobs[i]))
            touched[item.group.request_id] = item.group
        for request_id, pairs in beams.items():
            advance_beams(self.groups[request_id], [p[0] for p in pairs], np.stack([p[1] for p in pairs]),
                          self.block_manager, lambda: next(self._seq_ids), self.max_model_len)
        for group in touched.values():
            if group.first_token_time is None:
                group.first_token_time = now
                self.metrics.ttfts.append(now - group.arrival_time)
        return len(model_input.sampled) + num_emitted

    # ------------------------------------------------------------------ stats
    @property
    def _bytes_per_block_all_pools(self) -> int:
        """What moving one block id moves: its bytes in every pool (a draft model's too)."""
        return self.executor.bytes_per_block + (self.draft.cache.bytes_per_block if self.draft else 0)

    def get_stats(self) -> dict:
        bm, sched = self.block_manager, self.scheduler
        return self.metrics.snapshot(
            num_running=sum(len(g.unfinished_seqs()) for g in sched.running),
            num_waiting=sum(len(g.unfinished_seqs()) for g in sched.waiting),
            num_swapped=sum(len(g.unfinished_seqs()) for g in sched.swapped),
            kv_blocks_used=bm.num_used_blocks,
            kv_blocks_unshared=bm.num_mapped_blocks,
            kv_blocks_total=bm.num_blocks,
            kv_usage=bm.allocator.usage,
            cpu_kv_blocks_used=bm.cpu_allocator.num_used,
            cpu_kv_blocks_total=bm.cpu_allocator.num_blocks,
            cpu_kv_usage=bm.cpu_allocator.usage,
            num_preemptions=sched.num_preemptions,
            num_preemptions_swap=sched.num_preemptions_swap,
            num_preemptions_recompute=sched.num_preemptions_recompute,
            num_preemptions_partial=sched.num_preemptions_partial,
            blocks_swapped_out=sched.blocks_swapped_out,
            blocks_swapped_in=sched.blocks_swapped_in,
            bytes_swapped_out=sched.blocks_swapped_out * self._bytes_per_block_all_pools,
            bytes_swapped_in=sched.blocks_swapped_in * self._bytes_per_block_all_pools,
            prefix_cache_queries=bm.cache.queries if bm.cache else 0,
            prefix_cache_hits=bm.cache.hits if bm.cache else 0,
            prefix_cache_hit_rate=bm.cache.hit_rate if bm.cache else 0.0,
            max_concurrent_requests=self.metrics.max_concurrent_requests,
            kv_slots=measure(bm, sched, self.max_model_len).as_dict(),   # where the pool's slots are now
            fragmentation=summarize(self.kv_history),                    # averages over tracked steps
            spec_decode=self.spec.stats.as_dict() if self.spec is not None else None,
        )
