"""The sampler: each shaping rule keeps exactly the right tokens, draws follow the distribution."""

import numpy as np
import pytest

from minipaged.engine.sampler import Sampler, SampleRequest, log_softmax, shaped_probs
from minipaged.sampling_params import SamplingParams

LOGITS = np.log(np.array([0.05, 0.4, 0.3, 0.15, 0.1], dtype=np.float64))  # probabilities in disguise


def test_temperature_one_keeps_the_distribution():
    np.testing.assert_allclose(shaped_probs(LOGITS, SamplingParams()), np.exp(LOGITS), rtol=1e-6)


def test_temperature_sharpens():
    p = shaped_probs(LOGITS, SamplingParams(temperature=0.5))
    expected = np.exp(LOGITS) ** 2
    np.testing.assert_allclose(p, expected / expected.sum(), rtol=1e-6)


def test_top_k_keeps_the_k_most_likely():
    p = shaped_probs(LOGITS, SamplingParams(top_k=2))
    np.testing.assert_allclose(p, [0, 0.4 / 0.7, 0.3 / 0.7, 0, 0], rtol=1e-6)


@pytest.mark.parametrize("top_p,kept", [(0.4, [1]), (0.41, [1, 2]), (0.7, [1, 2]), (0.71, [1, 2, 3]), (1.0, [0, 1, 2, 3, 4])])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, kept):
    p = shaped_probs(LOGITS, SamplingParams(top_p=top_p))
    assert np.flatnonzero(p).tolist() == kept
    assert p.sum() == pytest.approx(1.0)


def test_min_p_drops_tokens_far_below_the_top():
    p = shaped_probs(LOGITS, SamplingParams(min_p=0.3))        # threshold 0.3 * 0.4 = 0.12
    assert np.flatnonzero(p).tolist() == [1, 2, 3]


def test_draws_follow_the_shaped_distribution():
    sampler = Sampler()
    params = SamplingParams(temperature=1.0, top_k=4)
    gen = np.random.default_rng(0)
    logits = np.tile(LOGITS.astype(np.float32), (4000, 1))
    results = sampler(logits, [SampleRequest(params, gen, [])] * 4000)
    counts = np.bincount([r.token_id for r in results], minlength=5) / 4000
    expected = shaped_probs(LOGITS, params)
    assert counts[0] == 0
    np.testing.assert_allclose(counts, expected, atol=0.03)    # ~4 standard errors


def test_greedy_seed_bans_and_logprobs():
    sampler = Sampler()
    logits = LOGITS.astype(np.float32)[None, :]
    gen = np.random.default_rng(0)
    greedy = sampler(logits, [SampleRequest(SamplingParams(temperature=0, logprobs=2), gen, [])])[0]
    assert greedy.token_id == 1
    assert greedy.logprob == pytest.approx(np.log(0.4), abs=1e-6)
    assert list(greedy.top_logprobs) == [1, 2]
    banned = sampler(logits, [SampleRequest(SamplingParams(temperature=0), gen, [1])])[0]
    assert banned.token_id == 2
    # the same seed gives the same draws
    a = [sampler(logits, [SampleRequest(SamplingParams(), np.random.default_rng(7), [])])[0].token_id
         for _ in range(20)]
    b = [sampler(logits, [SampleRequest(SamplingParams(), np.random.default_rng(7), [])])[0].token_id
         for _ in range(20)]
    assert a == b


def test_the_callers_logits_are_never_written():
    """Rows that ban, bias or penalise are adjusted in a copy; with none of them the sampler
    reads the caller's float32 logits as they are (no copy), and writes nothing either way."""
    sampler = Sampler()
    logits = np.tile(LOGITS.astype(np.float32), (3, 1))                       # (3, V)
    before = logits.copy()
    plain = [SampleRequest(SamplingParams(temperature=0), np.random.default_rng(0), [])] * 3
    assert sampler.adjust(logits, plain) is logits
    asking = [SampleRequest(SamplingParams(temperature=0), np.random.default_rng(0), [1]),
              SampleRequest(SamplingParams(temperature=0, logit_bias={3: 5.0}), np.random.default_rng(0), []),
              SampleRequest(SamplingParams(temperature=0, repetition_penalty=2.0), np.random.default_rng(0), [],
                            prompt_token_ids=[1], output_token_ids=[1])]
    adjusted = sampler.adjust(logits, asking)
    assert adjusted is not logits and adjusted[0, 1] == -np.inf and adjusted[1, 3] == logits[1, 3] + 5.0
    tokens = [r.token_id for r in sampler(logits, asking)]
    assert tokens == [2, 3, 2]        # banned; biased; penalised (log 0.4 x 2 falls below log 0.3)
    np.testing.assert_array_equal(logits, before)


def test_log_softmax_is_stable():
    row = np.array([[1000.0, 999.0, -1000.0]], dtype=np.float32)
    out = log_softmax(row)
    assert np.isfinite(out[0, :2]).all()
    assert np.exp(out).sum() == pytest.approx(1.0, abs=1e-6)
