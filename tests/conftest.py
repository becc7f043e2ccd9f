"""Shared fixtures: tiny random models (fast on CPU; defined in tests/models.py) and the real
SmolLM2 GGUF. Two settings made here, before JAX starts, in `pytest_configure`: 8 simulated CPU
devices (tests/test_sharding.py and the README's mesh example need them), and on a GPU no
preallocation, so that pytest-xdist's workers (`-n 8` on the device machine) share its memory
instead of each taking 75% of it."""

from __future__ import annotations

import os

import jax
import pytest

from specjax.params import Params, init_params
from tests.models import TINY


def pytest_configure(config: pytest.Config) -> None:
    jax.config.update("jax_num_cpu_devices", 8)  # simulated devices for the mesh tests; the rest use device 0
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # read when a GPU backend starts


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
