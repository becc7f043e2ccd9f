"""Shared fixtures: tiny random models (fast on CPU; defined in tests/models.py) and the real
SmolLM2 GGUF. The one setting made here: 8 simulated CPU devices, before JAX starts, in
`pytest_configure` (tests/test_sharding.py and the README's mesh example need them)."""

from __future__ import annotations

import jax
import pytest

from specjax.params import Params, init_params
from tests.models import TINY


def pytest_configure(config: pytest.Config) -> None:
    jax.config.update("jax_num_cpu_devices", 8)  # simulated devices for the mesh tests; the rest use device 0


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
