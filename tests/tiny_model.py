"""The tests' tiny random Llama (the writer lives in the package: minipaged.model.random_llama),
and the one way the tests build an LLM on it."""

from minipaged import LLM
from minipaged.model.random_llama import byte_symbols, random_tensors, tiny_config, write_tiny_llama  # noqa: F401


def make_llm(model_dir, **kwargs) -> LLM:
    """An LLM on ``model_dir``, on the CPU unless told otherwise."""
    kwargs.setdefault("device", "cpu")
    return LLM(model=str(model_dir), **kwargs)
