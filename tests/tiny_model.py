"""The tests' tiny random Llama (the writer lives in the package: minipaged.model.random_llama),
the one way the tests build an LLM on it, and one prefill-then-decode through a model."""

import numpy as np

from minipaged import LLM
from minipaged.kernels.layout import AttentionMetadata, kv_cache_shape
from minipaged.model.random_llama import byte_symbols, random_tensors, tiny_config, write_tiny_llama  # noqa: F401


def make_llm(model_dir, **kwargs) -> LLM:
    """An LLM on ``model_dir``, on the CPU unless told otherwise."""
    kwargs.setdefault("device", "cpu")
    return LLM(model=str(model_dir), **kwargs)


def prefill_then_decode(model, cfg, ids, table, block_size, before_decode=None) -> np.ndarray:
    """``model``'s logits (2, vocab): a prompt of ids[:-1] written through the block table
    ``table`` (1, blocks) of an 8-block pool, its last row; then one decode step of ids[-1], its
    row. ``before_decode(kv, step)`` runs between the two (a test's look at the planned step)."""
    prompt = len(ids) - 1
    slots = np.array([table[0, p // block_size] * block_size + p % block_size for p in range(prompt + 1)])
    kv = np.zeros(kv_cache_shape(cfg.num_hidden_layers, 8, cfg.num_key_value_heads, block_size, cfg.head_dim),
                  np.float32)         # (layers, 2, blocks, kv_heads, block, head_dim)
    pre = AttentionMetadata(slots[:prompt], np.array([0, prompt], np.int32), np.array([prompt], np.int32),
                            table, prompt, prompt)
    first = model.forward(ids[:prompt], np.arange(prompt), kv, pre, np.array([prompt - 1]))
    step = AttentionMetadata(slots[prompt:], np.array([0, 1], np.int32), np.array([prompt + 1], np.int32),
                             table, 1, prompt + 1)
    if before_decode is not None:
        before_decode(kv, step)
    return np.concatenate([first, model.forward(ids[prompt:], np.array([prompt]), kv, step, np.array([0]))])
