"""Incremental detokenization: text grows as tokens arrive, without decoding everything again.

Byte-level BPE tokens can split one UTF-8 character, and some tokenizers change
a token's text depending on its left neighbour (a leading space). So each step
decodes a short window twice, with and without the newest tokens, and emits
the difference, holding it back while it ends in half a character.
"""

from __future__ import annotations

from ..sequence import Sequence

# Tokens of left context kept in the decode window.
CONTEXT_TOKENS = 5


def start_offsets(seq: Sequence) -> None:
    """Point the window at the end of the prompt, with a little prompt context."""
    seq.read_offset = seq.num_prompt_tokens
    seq.prefix_offset = max(seq.num_prompt_tokens - CONTEXT_TOKENS, 0)


def detokenize_new_tokens(tokenizer, seq: Sequence, skip_special_tokens: bool,
                          final: bool = False, exclude_last: bool = False) -> str:
    """Text added by the tokens after ``seq.read_offset``; advances the window.

    ``final``: the sequence has ended, so a dangling half character is emitted
    (as U+FFFD) rather than held back for a continuation that will never come.
    ``exclude_last``: leave the newest token out (a stop token is not part of the answer).
    """
    ids = seq.token_ids
    end = len(ids) - 1 if exclude_last else len(ids)
    before = tokenizer.decode(ids[seq.prefix_offset:seq.read_offset], skip_special_tokens=skip_special_tokens)
    after = tokenizer.decode(ids[seq.prefix_offset:end], skip_special_tokens=skip_special_tokens)
    if len(after) > len(before) and (final or not after.endswith("\ufffd")):
        seq.prefix_offset = seq.read_offset
        seq.read_offset = end
        return after[len(before):]
    return ""  # nothing printable yet (half a character, or a skipped special token)
