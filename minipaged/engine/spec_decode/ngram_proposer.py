"""Prompt-lookup drafts (``speculative_config`` method ``ngram``): readahead for tokens.

An OS that sees a file read sequentially reads ahead the pages it expects next, for free if
it guessed right, at a small cost if not. A sequence that is copying, editing or quoting its
own context does the same with tokens: if its last n tokens appeared earlier, the tokens that
followed them then are a good guess for what follows now. No model runs to make the guess;
the target model checks it (engine/spec_decode.py).
"""

from __future__ import annotations

import numpy as np


def propose_ngram(token_ids, num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``num_tokens`` draft tokens for a sequence whose tokens so far are ``token_ids``.

    For n from ``max_n`` down to ``min_n``: find the latest earlier occurrence of the sequence's
    last n tokens (one that ends before the last token) and propose the ``num_tokens`` tokens
    that followed it. The longest n that matches wins; none: no draft. Where the copy runs
    into the present (a match one period back in a repeating text), it goes on reading the
    tokens it has just proposed, as the text would continue if it kept repeating.
    """
    tokens = np.asarray(token_ids, dtype=np.int64)          # (L,)
    length = tokens.shape[0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]                         # (n,)
        # windows starting at 0 .. length - n - 1: every earlier n-gram, not the suffix itself
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:length - 1], n)   # (length - n, n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.shape[0]:
            start = int(hits[-1]) + n                        # the token after the latest match
            extended = tokens.tolist()
            for j in range(num_tokens):                      # start + j < len(extended) always
                extended.append(extended[start + j])
            return extended[length:]
    return []
