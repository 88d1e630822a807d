"""The dense reference forward: the test oracle, never used to serve.

No KV cache, no paging, no fused weights, no kernels: every call recomputes full
causal attention over the whole sequence in float64 from the checkpoint's own
Hugging Face tensors. It is slow on purpose and shares no code with
``llama.py`` beyond reading the config, so when the two agree the paged engine
is right.
"""

from __future__ import annotations

import numpy as np

from .config import LlamaConfig
from .rope import inverse_frequencies


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rotate(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """x: (L, heads, d); HF's rotate_half: pairs (i, i + d/2)."""
    angles = positions[:, None] * inv_freq[None, :]              # (L, d/2)
    cos = np.concatenate([np.cos(angles)] * 2, -1)[:, None, :]   # (L, 1, d)
    sin = np.concatenate([np.sin(angles)] * 2, -1)[:, None, :]
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


class DenseReference:
    """Holds the checkpoint in float64; ``logits(ids)`` recomputes everything from scratch."""

    def __init__(self, config: LlamaConfig, tensors: dict[str, np.ndarray]) -> None:
        self.config = config
        self.w = {k: np.asarray(v, dtype=np.float64) for k, v in tensors.items()}

    def logits(self, token_ids: list[int]) -> np.ndarray:
        """Logits at every position of ``token_ids``: (L, vocab) float64."""
        return reference_logits(self.config, self.w, token_ids)

    def greedy(self, token_ids: list[int], max_new_tokens: int) -> list[int]:
        """Greedy continuation, one full recomputation per new token."""
        ids = list(token_ids)
        for _ in range(max_new_tokens):
            ids.append(int(np.argmax(self.logits(ids)[-1])))
        return ids[len(token_ids):]


def reference_logits(config: LlamaConfig, tensors: dict[str, np.ndarray],
                     token_ids: list[int]) -> np.ndarray:
    """Logits at every position of ``token_ids``: (L, vocab) float64."""
    c = config
    w = {k: np.asarray(v, dtype=np.float64) for k, v in tensors.items()}  # no copy if already float64
    ids = np.asarray(token_ids)
    L, H, Hkv, d = len(ids), c.num_attention_heads, c.num_key_value_heads, c.head_dim
    inv_freq = inverse_frequencies(c)
    positions = np.arange(L, dtype=np.float64)
    causal = np.triu(np.full((L, L), -np.inf), k=1)                  # (L, L) 0 on and below the diagonal
    x = w["model.embed_tokens.weight"][ids]                          # (L, hidden)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        mask = causal                                                # (L, L)
        if c.window(i):   # a sliding window: query q sees keys q - window + 1 .. q
            mask = causal + np.tril(np.full((L, L), -np.inf), k=-c.window(i))
        h = _rms_norm(x, w[p + "input_layernorm.weight"], c.rms_norm_eps)
        projected = []
        for name, heads in (("q", H), ("k", Hkv), ("v", Hkv)):
            y = h @ w[p + f"self_attn.{name}_proj.weight"].T            # (L, heads * d)
            if c.qkv_bias:
                y = y + w[p + f"self_attn.{name}_proj.bias"]
            projected.append(y.reshape(L, heads, d))
        q, k, v = projected
        if c.qk_norm:                                                 # per head, over d
            q = _rms_norm(q, w[p + "self_attn.q_norm.weight"], c.rms_norm_eps)
            k = _rms_norm(k, w[p + "self_attn.k_norm.weight"], c.rms_norm_eps)
        q, k = _rotate(q, positions, inv_freq), _rotate(k, positions, inv_freq)
        k = np.repeat(k, H // Hkv, axis=1)                           # (L, H, d): GQA by repetition
        v = np.repeat(v, H // Hkv, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d) + mask    # (H, L, L)
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        probs = scores / scores.sum(-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", probs, v).reshape(L, H * d)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        if c.o_bias:
            x = x + w[p + "self_attn.o_proj.bias"]
        h = _rms_norm(x, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        up = h @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    x = _rms_norm(x, w["model.norm.weight"], c.rms_norm_eps)
    tied = c.tie_word_embeddings or "lm_head.weight" not in w
    head = w["model.embed_tokens.weight"] if tied else w["lm_head.weight"]
    return x @ head.T
