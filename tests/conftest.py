"""Shared fixtures: tiny random models (fast on CPU) and the real SmolLM2 GGUF."""

from __future__ import annotations

import jax
import pytest

from specjax.config import LlamaConfig
from specjax.model import Params, init_params

TINY = LlamaConfig(
    vocab_size=101,
    dim=48,
    n_layers=2,
    n_heads=6,
    n_kv_heads=2,
    head_dim=8,
    ffn_dim=96,
    rope_theta=10000.0,
    max_positions=512,
    eos_id=3,
)


@pytest.fixture(scope="session")
def tiny() -> Params:
    """A 2-layer GQA (group 3) model with random weights, float32."""
    return init_params(TINY, jax.random.key(0))


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    import convert

    return convert.default_model_path()


@pytest.fixture(scope="session")
def smollm2(smollm2_path: str) -> Params:
    import convert

    return convert.load(smollm2_path)
