"""Measure the grammar libraries issue 44 chose between, on this machine (docs/structured_outputs.md).

For llguidance and outlines-core (xgrammar needs torch and triton, so it is listed, not run):
the time to compile a schema for SmolLM2's vocabulary, and the time to compute the next-token
masks of a batch of 1 and of 32 sequences, each walking its own random valid path through
the grammar. Run: ``python scripts/grammar_libraries.py`` (needs ``pip install outlines-core``).
"""

from __future__ import annotations

import json
import statistics
import time

import numpy as np

from minipaged.model.fetch import DEFAULT_MODEL, resolve_model
from minipaged.model.tokenizer import Tokenizer

SCHEMAS = {
    "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                "age": {"type": "integer"}},
               "required": ["name", "age"], "additionalProperties": False},
    "order": {"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string", "maxLength": 12}, "qty": {"type": "integer", "minimum": 1}},
            "required": ["sku", "qty"], "additionalProperties": False}, "maxItems": 5},
        "status": {"enum": ["new", "paid", "shipped"]}},
        "required": ["id", "items", "status"], "additionalProperties": False},
}
STEPS = 24


def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable stand-in character of each byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def walk(first_mask, advance, vocab: int, rng, steps: int) -> list[float]:
    """Per step: seconds to compute the batch's bitmasks; then each row takes a random allowed token."""
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        bits = first_mask()                                    # (B, ceil(V / 32)) int32
        times.append(time.perf_counter() - t)
        masks = np.unpackbits(bits.view(np.uint8), bitorder="little").reshape(bits.shape[0], -1)
        tokens = []
        for row in masks:
            allowed = np.flatnonzero(row[:vocab])
            tokens.append(int(rng.choice(allowed)) if allowed.size else None)
        if not advance(tokens):
            break
    return times


def run_llguidance(tok: Tokenizer, vocab: int, schema: dict, batch: int) -> tuple[float, float]:
    import llguidance
    import llguidance.numpy as lnp
    lltok = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=vocab, eos_token=tok.eos_token_id)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    t = time.perf_counter()
    matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(batch)]
    compile_s = (time.perf_counter() - t) / batch
    executor = llguidance.LLExecutor(num_threads=2)
    bits = lnp.allocate_token_bitmask(batch, vocab)            # (B, ceil(V / 32)) int32

    def masks():
        lnp.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], bits)
        return bits

    def advance(tokens):
        live = False
        for m, t in zip(matchers, tokens):
            if t is not None and not m.is_stopped():
                m.consume_token(t)
                live = True
        return live
    times = walk(masks, advance, vocab, np.random.default_rng(0), STEPS)
    return compile_s, statistics.median(times)


def run_outlines(tok: Tokenizer, vocab: int, schema: dict, batch: int) -> tuple[float, float]:
    import outlines_core
    decode = byte_decoder()
    table: dict[bytes, list[int]] = {}
    for token, index in tok.backend.get_vocab().items():
        if index == tok.eos_token_id:
            continue
        raw = bytes(decode[c] for c in token) if all(c in decode for c in token) else token.encode()
        table.setdefault(raw, []).append(index)
    t = time.perf_counter()
    regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(schema))
    index = outlines_core.Index(regex, outlines_core.Vocabulary(tok.eos_token_id, table))
    compile_s = time.perf_counter() - t
    guides = [outlines_core.Guide(index) for _ in range(batch)]
    bits = np.zeros((batch, (vocab + 31) // 32), dtype=np.int32)

    def masks():
        for i, g in enumerate(guides):
            g.write_mask_into(bits[i].ctypes.data, bits.shape[1], 4)
        return bits

    def advance(tokens):
        live = False
        for g, t in zip(guides, tokens):
            if t is not None and not g.is_finished():
                g.advance(t)
                live = True
        return live
    times = walk(masks, advance, vocab, np.random.default_rng(0), STEPS)
    return compile_s, statistics.median(times)


def main() -> None:
    path = resolve_model(DEFAULT_MODEL)
    tok = Tokenizer.from_dir(path)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    print(f"vocabulary {vocab}; {STEPS} steps a walk; times are medians")
    print(f"{'library':14} {'schema':8} {'compile ms':>10} {'mask ms B=1':>12} {'mask ms B=32':>13}")
    for name, schema in SCHEMAS.items():
        for library, run in (("llguidance", run_llguidance), ("outlines-core", run_outlines)):
            compile_s, one = run(tok, vocab, schema, 1)
            _, many = run(tok, vocab, schema, 32)
            print(f"{library:14} {name:8} {compile_s * 1e3:10.1f} {one * 1e3:12.3f} {many * 1e3:13.3f}")


if __name__ == "__main__":
    main()
