"""One workload, run on one worker and on many, recorded so that the runs can be compared.

The driver's scheduler and block manager are the same whatever the workers, so two runs of
one workload take the same steps: step by step, the logits the executor returns must agree,
and so must every token.
"""

from __future__ import annotations

import numpy as np

from minipaged import SamplingParams
from tiny_model import make_llm


def workload(prefix: str, n: int = 3) -> list[tuple[str, str, SamplingParams]]:
    """Greedy requests sharing a long prefix (prefix caching), a sampled one with ``n`` samples
    (copy-on-write forks), and a long one: a small pool must preempt some of them."""
    greedy = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    return [
        ("a", prefix + " one two three", greedy),
        ("b", prefix + " four five", greedy),
        ("c", "the quick brown fox jumps over the lazy dog", greedy),
        ("d", prefix + " sixty", SamplingParams(n=n, temperature=0.8, seed=7, max_tokens=10, ignore_eos=True)),
        ("e", "z", greedy),
    ]


class Run:
    def __init__(self, model_dir, requests, **engine_kwargs) -> None:
        self.llm = make_llm(model_dir, **engine_kwargs)
        engine = self.engine = self.llm.llm_engine
        self.logits: list[np.ndarray] = []      # one (R, vocab) array per forward pass
        self.copies = 0                          # copy-on-write block copies planned
        executor = engine.executor
        real_execute, real_move = executor.execute_model, executor.move_blocks

        def execute(model_input):
            out = real_execute(model_input)
            self.logits.append(np.array(out))
            return out

        def move(swap_out, swap_in, copy):
            self.copies += len(copy)
            real_move(swap_out, swap_in, copy)

        executor.execute_model, executor.move_blocks = execute, move
        for request_id, prompt, params in requests:
            engine.add_request(request_id, prompt, params)
        self.tokens: dict[str, list[list[int]]] = {}
        for _ in range(2000):                    # bounded: a run is a few dozen steps
            if not engine.has_unfinished_requests():
                break
            for out in engine.step():
                if out.finished:
                    self.tokens[out.request_id] = [c.token_ids for c in out.outputs]
        assert not engine.has_unfinished_requests()
        self.stats = engine.get_stats()


def assert_same_run(got: Run, want: Run, atol: float = 1e-4) -> None:
    assert got.tokens == want.tokens
    assert len(got.logits) == len(want.logits)
    for step, (a, b) in enumerate(zip(got.logits, want.logits)):
        assert a.shape == b.shape, f"step {step}: {a.shape} vs {b.shape}"
        if a.size:
            err = float(np.max(np.abs(a - b)))
            assert err <= atol, f"step {step}: logits differ by {err}"
