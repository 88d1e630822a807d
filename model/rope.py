"""Rotary position embedding tables: the angle each position turns each pair of dimensions by."""

from __future__ import annotations

import math

import numpy as np

from .config import LlamaConfig


def inverse_frequencies(config: LlamaConfig) -> np.ndarray:
    """(head_dim // 2,) float64: the rotation speed of each dimension pair, scaling applied."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        # Llama 3.1: slow the low frequencies down by `factor`, keep the high ones,
        # and blend smoothly in between (wavelengths measured against the original context).
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = np.where(wavelen > old_len / low, inv_freq / factor,
                            np.where(wavelen < old_len / high, inv_freq, blended))
    return inv_freq


def rope_tables(config: LlamaConfig, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin: (max_positions, head_dim // 2) float32, indexed by token position."""
    angles = np.outer(np.arange(max_positions, dtype=np.float64), inverse_frequencies(config))
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
