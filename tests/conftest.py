import json
import sys
from pathlib import Path

import minipaged  # noqa: F401  (first, so OpenBLAS is told not to spin; see minipaged/boot.py)
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/tiny_model.py

from tiny_model import write_tiny_llama  # noqa: E402

GOLDEN = Path(__file__).parent / "golden" / "smollm2_135m_instruct.json"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def untied_model_dir(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-untied"), seed=1,
                            tie_word_embeddings=False, num_key_value_heads=1)


@pytest.fixture(scope="session")
def calm_model_dir(tmp_path_factory) -> Path:
    """Logits of a few units rather than tens: float32 sums of several log-probs stay within 1e-6."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-calm"), seed=2, embed_scale=0.2)


@pytest.fixture(scope="session")
def golden() -> dict:
    return json.loads(GOLDEN.read_text())


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """The dense, cache-free float64 forward of the tiny model: the engine's oracle."""
    from minipaged.model.config import LlamaConfig
    from minipaged.model.reference import DenseReference
    from minipaged.model.weights import load_checkpoint

    return DenseReference(LlamaConfig.from_dir(tiny_model_dir), load_checkpoint(tiny_model_dir))


@pytest.fixture(scope="session")
def long_model_dir_for_soak(tmp_path_factory) -> Path:
    """The tiny model with a 2048-token context: the soak's prompts near the limit are long."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-2k"), max_position_embeddings=2048)


# The engine-level suites run under both CPU tiers of kernels (kernels/ops.py): each of their tests
# twice, [fast] and [simple], every engine the test makes given that tier through $MINIPAGED_KERNELS
# (EngineConfig.kernels' default, as vLLM's VLLM_ATTENTION_BACKEND). A module-wide baseline (an
# engine made once by a module fixture) stays on the default tier, the fast one: a [simple] test
# then checks the plain tier against it. tests/test_tiers.py compares the tiers head to head.
BOTH_TIERS = {"test_engine", "test_preemption", "test_sharing", "test_spec_decode", "test_kv_cache_dtype",
              "test_demand_paging", "test_penalties", "test_model_families"}


def pytest_generate_tests(metafunc):
    # a test marked one_tier runs once, on the default tier: SmolLM2-sized runs, whose plain-tier
    # counterpart is tests/test_tiers.py's golden prompts (each cost ~7-15 s of CI time again)
    if (metafunc.module.__name__ in BOTH_TIERS and "kernels_tier" in metafunc.fixturenames
            and metafunc.definition.get_closest_marker("one_tier") is None):
        metafunc.parametrize("kernels_tier", ["fast", "simple"], indirect=True)


@pytest.fixture(autouse=True)
def kernels_tier(request, monkeypatch):
    """The tier this test's engines run on (a BOTH_TIERS suite's parameter), else the default."""
    tier = getattr(request, "param", None)
    if tier is not None:
        monkeypatch.setenv("MINIPAGED_KERNELS", tier)
    return tier
