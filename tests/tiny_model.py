"""The tests' tiny random Llama (the writer lives in the package: minipaged.model.random_llama)."""

from minipaged.model.random_llama import byte_symbols, random_tensors, tiny_config, write_tiny_llama  # noqa: F401
