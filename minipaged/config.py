"""Frozen, self-validating configuration: the "boot parameters" of the engine.

Every knob is checked when the object is built, so a bad value fails at once
with a sentence that names it, never later inside a kernel.
"""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A configuration value is out of range or inconsistent."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _is_int(value) -> bool:
    """An integer, numpy's too, but not a bool (``seed=True`` is a mistake, not 1)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


# vLLM's names; kernels/kv_quant.py says what each stores
KV_CACHE_DTYPE_NAMES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True)
class CacheConfig:
    """Shape of the physical KV pool: frames of ``block_size`` token slots."""

    block_size: int = 16
    num_blocks: int | None = None        # pool size in blocks; None: derived from the space
    kv_cache_space: float | None = None  # pool size in GiB (CPU); None: 4 GiB, as vLLM's CPU backend
    swap_space: float = 4.0              # GiB of CPU memory for blocks swapped out (vLLM's default)
    watermark: float = 0.01              # fraction of the pool kept free when admitting
    gpu_memory_utilization: float = 0.9  # GPU: share of device memory for weights + activations + KV
    kv_cache_dtype: str = "auto"         # auto (the compute dtype), int8, fp8 (= fp8_e4m3), fp8_e5m2
    calculate_kv_scales: bool = False    # fp8: per-layer scales from the first step's K/V, not 1.0
    sparse_attention_budget: int | None = None   # tokens a decoding head attends to (Quest); None: dense

    def __post_init__(self) -> None:
        _require(isinstance(self.block_size, int) and is_power_of_two(self.block_size)
                 and self.block_size <= 256,
                 f"block_size must be a power of two between 1 and 256, got {self.block_size!r}")
        _require(self.num_blocks is None or (isinstance(self.num_blocks, int) and self.num_blocks > 0),
                 f"num_blocks must be a positive integer, got {self.num_blocks!r}")
        _require(self.kv_cache_space is None
                 or (isinstance(self.kv_cache_space, (int, float)) and self.kv_cache_space > 0),
                 f"kv_cache_space must be a positive number of GiB, got {self.kv_cache_space!r}")
        _require(isinstance(self.swap_space, (int, float)) and self.swap_space >= 0,
                 f"swap_space must be a number of GiB >= 0, got {self.swap_space!r}")
        _require(isinstance(self.watermark, (int, float)) and 0 <= self.watermark < 1,
                 f"watermark must be in [0, 1), got {self.watermark!r}")
        _require(isinstance(self.gpu_memory_utilization, (int, float)) and 0 < self.gpu_memory_utilization <= 1,
                 f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        _require(self.kv_cache_dtype in KV_CACHE_DTYPE_NAMES,
                 f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPE_NAMES)}, got {self.kv_cache_dtype!r}")
        _require(self.sparse_attention_budget is None
                 or (_is_int(self.sparse_attention_budget) and self.sparse_attention_budget >= 2 * self.block_size),
                 f"sparse_attention_budget must be a number of tokens >= 2 * block_size "
                 f"({2 * self.block_size}: the first and the last block are always kept), "
                 f"got {self.sparse_attention_budget!r}")
        _require(isinstance(self.calculate_kv_scales, bool),
                 f"calculate_kv_scales must be True or False, got {self.calculate_kv_scales!r}")


PREEMPTION_MODES = ("swap", "recompute", "auto", "partial")


@dataclass(frozen=True)
class SchedulerConfig:
    """Budgets of one scheduling step (how much work the "CPU scheduler" may dispatch)."""

    max_model_len: int                         # longest sequence (prompt + output) a request may reach
    max_num_seqs: int = 256                    # sequences running at once
    max_num_batched_tokens: int | None = None  # tokens per step; None: see below
    enable_chunked_prefill: bool = False       # split long prompts over several steps
    preemption_mode: str = "auto"              # how a request gives its blocks back: swap, recompute,
                                               # auto, or partial (swap out only the blocks a step lacks)
    num_scheduler_steps: int = 1               # decode steps run per scheduling decision

    def __post_init__(self) -> None:
        _require(isinstance(self.max_model_len, int) and self.max_model_len > 0,
                 f"max_model_len must be a positive integer, got {self.max_model_len!r}")
        _require(isinstance(self.max_num_seqs, int) and self.max_num_seqs > 0,
                 f"max_num_seqs must be a positive integer, got {self.max_num_seqs!r}")
        _require(self.preemption_mode in PREEMPTION_MODES,
                 f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        _require(isinstance(self.num_scheduler_steps, int) and self.num_scheduler_steps >= 1,
                 f"num_scheduler_steps must be a positive integer, got {self.num_scheduler_steps!r}")
        if self.max_num_batched_tokens is None:
            # Without chunking a whole prompt must fit in one step.
            default = max(2048, self.max_num_seqs,
                          0 if self.enable_chunked_prefill else self.max_model_len)
            object.__setattr__(self, "max_num_batched_tokens", default)
        budget = self.max_num_batched_tokens
        _require(isinstance(budget, int) and budget >= self.max_num_seqs,
                 f"max_num_batched_tokens ({budget!r}) must be at least max_num_seqs "
                 f"({self.max_num_seqs}), so every running sequence can decode in one step")
        _require(self.enable_chunked_prefill or budget >= self.max_model_len,
                 f"max_num_batched_tokens ({budget}) must be at least max_model_len "
                 f"({self.max_model_len}) so that any prompt fits in one step; or turn on "
                 "enable_chunked_prefill")


DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "float16", "bfloat16")   # the CPU computes in float32 (bf16 widened on load)
CPU_GEMMS = ("auto", "mkl", "numba")      # the fast tier's linear layers (kernels/fast/packed_gemm.py)
KERNEL_TIERS = ("fast", "simple")         # the CPU's tiers of kernels (kernels/ops.py); a GPU runs CUDA's
QUANTIZATIONS = (None, "int8", "gguf", "gguf_a8")   # weights in fewer bytes on the CPU (kernels/weight_formats.py)


def default_kernels() -> str:
    """The CPU's tier when none is asked for: $MINIPAGED_KERNELS (as vLLM's VLLM_ATTENTION_BACKEND
    names a backend for every engine a process makes), else "fast"."""
    return os.environ.get("MINIPAGED_KERNELS", "fast")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine was asked for, before the model is loaded."""

    model: str = "smollm2-135m-instruct"
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    max_logprobs: int = 20   # most logprobs a request may ask for (vLLM's default); -1: no cap
    cpu_gemm: str = "auto"   # the CPU's linear layers: auto (each kind of step the engine timed faster here), mkl, numba
    kernels: str = field(default_factory=default_kernels)   # the CPU's tier: "fast" (kernels/fast/) or "simple"
    # the CPU's weights in fewer bytes: None (as dtype says: float32, or bfloat16), "int8" (a scale
    # per output row), "gguf" (the model's GGUF file's own blocks: Q4_1, Q8_0), "gguf_a8" (those
    # blocks, every product reading x rounded to int8, as llama.cpp's do); vLLM's --quantization
    quantization: str | None = None

    def __post_init__(self) -> None:
        _require(isinstance(self.model, str) and self.model != "", "model must be a name or a path")
        _require(self.device in DEVICES, f"device must be one of {DEVICES}, got {self.device!r}")
        _require(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _require(self.cpu_gemm in CPU_GEMMS, f"cpu_gemm must be one of {CPU_GEMMS}, got {self.cpu_gemm!r}")
        _require(self.kernels in KERNEL_TIERS, f"kernels must be one of {KERNEL_TIERS}, got {self.kernels!r}"
                 + (" (from $MINIPAGED_KERNELS)" if self.kernels == os.environ.get("MINIPAGED_KERNELS") else ""))
        _require(not (self.kernels == "simple" and self.cpu_gemm == "mkl"),
                 "cpu_gemm='mkl' is an engine of the fast tier; kernels='simple' multiplies with numpy's BLAS "
                 "(use kernels='fast', or leave cpu_gemm at 'auto')")
        _require(self.quantization in QUANTIZATIONS,
                 f"quantization must be one of {', '.join(str(q) for q in QUANTIZATIONS)}, got {self.quantization!r}")
        _require(self.quantization is None or self.dtype in ("auto", "float32"),
                 f"dtype={self.dtype!r} and quantization={self.quantization!r} both choose how the weights are "
                 "stored; give one of them")
        _require(_is_int(self.seed) and self.seed >= 0,
                 f"seed must be a non-negative integer, got {self.seed!r}")
        # A cap, not a cost: each request's top-k is one partition of its logits row,
        # but returning the whole vocabulary every token is rarely what was meant.
        _require(_is_int(self.max_logprobs) and self.max_logprobs >= -1,
                 f"max_logprobs must be an integer >= 0, or -1 for no cap, got {self.max_logprobs!r}")
        object.__setattr__(self, "seed", int(self.seed))
        object.__setattr__(self, "max_logprobs", int(self.max_logprobs))


SPECULATIVE_METHODS = ("ngram", "draft_model")
_SPECULATIVE_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model",
                     "adaptive")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``speculative_config``): draft tokens cheaply, verify them all
    in one pass of the model, keep the longest prefix the model agrees with.

    ``ngram`` (prompt lookup) drafts the tokens that followed the last earlier occurrence of the
    sequence's final n-gram (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``);
    ``draft_model`` drafts with a second, smaller Llama (``model``) sharing the tokenizer.
    ``adaptive``: each request's draft length follows its running acceptance rate, down to none
    (engine/spec_decode.py); False keeps it at ``num_speculative_tokens``.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None
    adaptive: bool = True

    def __post_init__(self) -> None:
        _require(self.method in SPECULATIVE_METHODS,
                 f"speculative_config method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        _require(_is_int(self.num_speculative_tokens) and 1 <= self.num_speculative_tokens <= 16,
                 f"speculative_config num_speculative_tokens must be an integer in [1, 16], "
                 f"got {self.num_speculative_tokens!r}")
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            _require(_is_int(value) and value >= 1, f"speculative_config {name} must be an integer >= 1, got {value!r}")
        _require(self.prompt_lookup_min <= self.prompt_lookup_max,
                 f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                 f"prompt_lookup_max ({self.prompt_lookup_max})")
        _require(isinstance(self.adaptive, bool), f"speculative_config adaptive must be true or false, "
                                                  f"got {self.adaptive!r}")
        if self.method == "draft_model":
            _require(isinstance(self.model, str) and self.model != "",
                     "speculative_config method 'draft_model' needs a model (a name or a Llama directory)")
        else:
            _require(self.model is None, f"speculative_config model is only for method 'draft_model', "
                                         f"got model={self.model!r} with method {self.method!r}")

    @classmethod
    def from_value(cls, value) -> "SpeculativeConfig | None":
        """None, a SpeculativeConfig, a dict with vLLM's keys, or that dict as a JSON string."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            import json  # noqa: PLC0415

            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise ConfigError(f"speculative_config is not valid JSON: {err}") from None
        _require(isinstance(value, dict), f"speculative_config must be a dict (or its JSON), got {value!r}")
        unknown = sorted(set(value) - set(_SPECULATIVE_KEYS))
        _require(not unknown, f"speculative_config has unknown keys {unknown}; known: {list(_SPECULATIVE_KEYS)}")
        return cls(**value)


EXECUTOR_BACKENDS = ("uni", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    """How many workers share the model, and how they are placed (vLLM's names).

    ``tensor_parallel_size`` workers split every layer by heads and MLP columns (they all see the
    same tokens and the same block tables); ``pipeline_parallel_size`` stages split the layers
    into contiguous runs. ``distributed_executor_backend``: ``uni`` keeps every worker in this
    process (its all-reduce is a plain sum), ``ray`` makes each one a Ray actor.
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str = "uni"

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            _require(_is_int(value) and value >= 1, f"{name} must be a positive integer, got {value!r}")
        _require(self.distributed_executor_backend in EXECUTOR_BACKENDS,
                 f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}, "
                 f"got {self.distributed_executor_backend!r}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def check_model(self, *, num_attention_heads: int, num_key_value_heads: int, intermediate_size: int,
                    num_hidden_layers: int) -> None:
        """Refuse, before any weight is read, a model these sizes cannot split evenly."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        for what, count in (("query heads (num_attention_heads)", num_attention_heads),
                            ("KV heads (num_key_value_heads)", num_key_value_heads),
                            ("MLP columns (intermediate_size)", intermediate_size)):
            _require(count % tp == 0, f"tensor_parallel_size={tp} does not divide the model's {count} {what}; "
                                      f"choose a tensor_parallel_size that divides {count}")
        _require(pp <= num_hidden_layers, f"pipeline_parallel_size={pp} exceeds the model's {num_hidden_layers} "
                                          "layers: every stage needs at least one layer")
